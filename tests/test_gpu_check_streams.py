"""The pieces of the stream tests (tests/test_gpu_streams.py, tests/test_gpu_sanitizer.py) on CPU:
the stand-in collectives on 4 real gloo ranks (poisoned until wait, exact after, eager and
compiled, torch's kernels back after uninstall), its CUDA path with fake streams, the launcher's
spawned one-GPU world, the planted bugs, the delay op, the comparison with the reference, the
sync counter, the sanitizer's ranks with CUDA faked, and the GPU check's version row."""
from __future__ import annotations

import math
import time
import warnings

import pytest
import torch

import standin
import stream_workload as sw
from dist_harness import run_world
from tools.gpu_check import checks
from tools.local_world import run_local_world


# ---- the stand-in on 4 ranks -----------------------------------------------------------------------
def standin_probe(_: object) -> dict:
    """Every kind of stand-in op on the intra group of a 2 x 2 mesh: poisoned before wait_tensor,
    equal to plain gloo after it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ops = torch.ops._c10d_functional
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    intra = mesh.get_group("intra")
    name, k, rank = intra.group_name, intra.size(), dist.get_rank()
    x = torch.arange(6.0) + 10 * rank
    gathered = torch.empty(6 * k)
    dist.all_gather(list(gathered.chunk(k)), x, group=intra)
    summed = x.clone()
    dist.all_reduce(summed, group=intra)
    mine = summed.chunk(k)[intra.rank()]
    out: dict = {}
    with standin.StandIn("cpu") as si:
        ag = ops.all_gather_into_tensor(x, k, name)
        out["gather"] = (bool(ag.isnan().all()), torch.equal(ops.wait_tensor(ag), gathered))
        rs = ops.reduce_scatter_tensor(x, "avg", k, name)
        out["reduce_scatter_avg"] = (bool(rs.isnan().all()), torch.allclose(ops.wait_tensor(rs), mine / k))
        ar = ops.all_reduce(x, "sum", name)
        out["all_reduce"] = (bool(ar.isnan().all()), torch.equal(ops.wait_tensor(ar), summed))
        y = x.clone()
        ops.all_reduce_(y, "sum", name)
        out["all_reduce_"] = (bool(y.isnan().all()), torch.equal(ops.wait_tensor(y), summed))
        ints = ops.all_gather_into_tensor(torch.arange(3) + rank, k, name)
        out["int_poison"] = bool((ints == torch.iinfo(torch.int64).min).all())
        ops.wait_tensor(ints)
        pair = ops.all_gather_into_tensor_coalesced([x, 2 * x], k, name)
        out["coalesced"] = (all(bool(t.isnan().all()) for t in pair),
                            all(torch.equal(ops.wait_tensor(t), g) for t, g in zip(pair, (gathered, 2 * gathered))))
        late = x.clone()
        res = ops.all_gather_into_tensor(late, k, name)
        late += 1000  # changed after the issue: the collective reads it at wait(), as late as NCCL may
        out["reads_at_wait"] = bool((ops.wait_tensor(res) >= 1000).all())
        f = torch.compile(lambda t: ops.wait_tensor(ops.all_gather_into_tensor(t, k, name)) * 2, backend="aot_eager",
                          fullgraph=True)
        out["compiled"] = torch.equal(f(x), 2 * gathered)
        before = si.stats.snapshot()
        ops.all_reduce(x, "sum", name)  # never waited, on every rank: never run, on any rank
        out["never_waited"] = si.stats.since(before)["never_waited"]
        out["issued"] = si.stats.snapshot()["issued"]
    works = si.stats.works
    back = ops.wait_tensor(ops.all_reduce(x, "sum", name))  # torch's kernel again
    out["uninstalled"] = (torch.equal(back, summed), si.stats.works == works)
    return out


def test_standin_poisons_until_wait_and_is_exact_after():
    for r in run_world(4, "test_gpu_check_streams:standin_probe"):
        for key in ("gather", "reduce_scatter_avg", "all_reduce", "all_reduce_", "coalesced"):
            assert r[key] == (True, True), (key, r[key])
        assert r["int_poison"] and r["reads_at_wait"] and r["compiled"]
        assert r["never_waited"] == 1
        assert r["uninstalled"] == (True, True)
        assert {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_reduce_",
                "all_gather_into_tensor_coalesced"} <= r["issued"].keys()


class _FakeEvent:
    def __init__(self, stream: "_FakeStream") -> None:
        self.stream = stream

    def query(self) -> bool:
        return True


class _FakeStream:
    """A CUDA stream's interface on CPU: records what is done on or to it (every op runs at once)."""

    log: list = []
    current: list = []

    def __init__(self, name: str = "") -> None:
        self.name = name or f"s{len(_FakeStream.log)}"

    def wait_stream(self, other: "_FakeStream") -> None:
        _FakeStream.log.append((self.name, "waits for stream", other.name))

    def wait_event(self, event: _FakeEvent) -> None:
        _FakeStream.log.append((self.name, "waits for event of", event.stream.name))

    def record_event(self) -> _FakeEvent:
        _FakeStream.log.append((self.name, "records", ""))
        return _FakeEvent(self)


def cuda_branch_probe(_: object) -> dict:
    """The stand-in's CUDA code path on CPU tensors, with torch.cuda's streams, sleep and pinned
    memory replaced by fakes that record the order of operations."""
    import contextlib
    from unittest import mock

    import torch.distributed as dist

    ops = torch.ops._c10d_functional
    issuing = _FakeStream("side")
    _FakeStream.current[:] = [issuing]
    streams = iter([_FakeStream("input"), _FakeStream("result")])

    @contextlib.contextmanager
    def on(stream):
        _FakeStream.current.append(stream)
        try:
            yield
        finally:
            _FakeStream.current.pop()

    def sleep(cycles: int) -> None:
        _FakeStream.log.append((_FakeStream.current[-1].name, "sleeps", str(cycles)))

    si = standin.StandIn("cuda", 7)
    with mock.patch.multiple(torch.cuda, current_stream=lambda device=None: _FakeStream.current[-1],
                             Stream=lambda device=None: next(streams), stream=on, _sleep=sleep,
                             get_sync_debug_mode=lambda: 1, set_sync_debug_mode=lambda mode: _FakeStream.log.append(
                                 ("host", "sync debug", str(mode)))), \
            mock.patch.object(standin, "pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype)), \
            mock.patch.object(torch.Tensor, "pin_memory", lambda self: self.clone()):
        lib = torch.library.Library("_c10d_functional", "IMPL")
        for name, fn in si._kernels().items():  # the CUDA kernels, registered for CPU tensors
            lib.impl(name, si._counted(name, fn), "CPU", allow_override=True)
        world = dist.group.WORLD
        x = torch.arange(4.0) + 10 * dist.get_rank()
        out = ops.all_gather_into_tensor(x, 2, world.group_name)
        poisoned = bool(out.isnan().all())
        at_issue = list(_FakeStream.log)
        _FakeStream.log.clear()
        result = ops.wait_tensor(out).clone()
        at_wait = list(_FakeStream.log)
        lib._destroy()
    return {"poisoned": poisoned, "result": result, "at_issue": at_issue, "at_wait": at_wait}


def test_standin_cuda_path_orders_its_streams_as_nccl():
    """At the issue the input stream waits for the issuing one (and records after copying the input
    and poisoning the output); at wait() the result stream waits for that, sleeps, writes, records,
    and the waiting stream waits for it; the sync debug mode is off meanwhile."""
    results = run_world(2, "test_gpu_check_streams:cuda_branch_probe")
    for r in results:
        assert r["poisoned"] and torch.equal(r["result"], torch.cat([torch.arange(4.0), torch.arange(4.0) + 10]))
        assert r["at_issue"] == [("input", "waits for stream", "side"), ("input", "records", "")]
        assert r["at_wait"] == [("host", "sync debug", "0"), ("result", "waits for event of", "input"),
                                ("result", "sleeps", "7"), ("result", "records", ""), ("host", "sync debug", "1"),
                                ("side", "waits for event of", "result")]


def test_the_cuda_apis_parts_d_and_e_call_exist_in_this_torch():
    """What the CUDA paths call (they cannot run here): present in every supported torch."""
    import torch.cuda._sanitizer as csan

    for owner, names in ((torch.cuda, ("current_stream", "stream", "Stream", "Event", "_sleep", "get_sync_debug_mode",
                                       "set_sync_debug_mode", "max_memory_reserved", "max_memory_allocated",
                                       "reset_peak_memory_stats", "set_device", "init", "synchronize")),
                         (torch.cuda.Stream, ("wait_stream", "wait_event", "record_event")),
                         (torch.cuda.Event, ("query", "synchronize", "elapsed_time", "record")),
                         (torch.cuda.nccl, ("version",)), (csan.cuda_sanitizer, ("enabled",)),
                         (torch._C._distributed_c10d, ("_register_work",))):
        missing = [n for n in names if not hasattr(owner, n)]
        assert not missing, (owner, missing)
    assert csan.CUDASanitizerErrors.__name__ == "CUDASanitizerErrors"


def test_poison_values_and_bad_input():
    assert math.isnan(standin.poison_value(torch.float32)) and math.isnan(standin.poison_value(torch.bfloat16))
    assert standin.poison_value(torch.int32) == -2**31 and standin.poison_value(torch.bool) is True
    with pytest.raises(ValueError, match="device 'xpu' is invalid; valid: cpu, cuda"):
        standin.StandIn("xpu")
    with pytest.raises(ValueError, match="result_delay_cycles must be >= 0"):
        standin.StandIn("cuda", -1)
    with pytest.raises(ValueError, match="reduce op 'bogus' is not supported"):
        standin.host_reduce(torch.ones(2), "bogus", None)


# ---- the launcher's one-GPU world ---------------------------------------------------------------------
def world_target(payload: dict) -> dict:
    import os

    import torch.distributed as dist

    if dist.get_rank() == payload.get("fail_rank"):
        raise RuntimeError("planned failure")
    if payload.get("hang"):
        time.sleep(60)
    return {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME", "PROBE")}


@pytest.mark.slow  # spawned ranks import torch afresh (20 s on 2 cores): make test-all
def test_one_gpu_world_is_spawned_on_gpu_0_and_a_failure_stops_it():
    """``device="cuda"``: spawned ranks (no CUDA needed to start them), every one on GPU 0 with the
    environment given; a rank that raises fails the world while another one still hangs."""
    got = run_local_world(2, "test_gpu_check_streams:world_target", {}, 120, device="cuda", env={"PROBE": "x"})
    assert got == [{"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": "lo", "PROBE": "x"}] * 2
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="planned failure"):
        run_local_world(2, "test_gpu_check_streams:world_target", {"fail_rank": 1, "hang": True}, 120)
    assert time.monotonic() - t0 < 30  # rank 0 hangs: killed after the failure, not at the timeout
    with pytest.raises(RuntimeError, match="no result within 3 s"):
        run_local_world(2, "test_gpu_check_streams:world_target", {"hang": True}, 3)


# ---- the planted bugs ---------------------------------------------------------------------------------
def test_plants_patch_the_engine_and_restore_it():
    from paro_fsdp import comm, streams

    wait, issue, swait = comm.Pending.wait, streams.CommStreams.issue, streams.CommStreams.wait
    pending = comm.Pending(torch.ones(2), issued=True)
    with sw.planted("missing-wait", "cpu"):
        assert comm.Pending.wait is not wait and pending.wait() is pending.tensor
        assert streams.CommStreams.wait(object()) is None
    assert comm.Pending.wait is wait and streams.CommStreams.wait is swait and streams.CommStreams.issue is issue
    with sw.planted(None, "cpu"):
        assert comm.Pending.wait is wait
    for bad in ("issue-wait", "typo"):
        with pytest.raises(ValueError, match="valid missing-wait"):
            with sw.planted(bad, "cpu"):
                pass


# ---- the workload: delay op, comparison -------------------------------------------------------------
def test_delay_op_is_a_copy_with_a_gradient_and_compiles_in_a_block():
    x = torch.randn(3, requires_grad=True)
    y = sw.delay(x, 0)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3))
    model = sw.make_model()
    sw.add_delays(model, 0)
    tokens = sw.batch(0, 0, 0)
    eager = model(tokens).loss
    torch._dynamo.reset()
    compiled = torch.compile(model.layers[0], backend="aot_eager", fullgraph=True)  # the hook's op stays in the graph
    h = model.tok_embeddings(tokens[:, :-1])
    cos, sin = model.rope_cos[: h.shape[1]], model.rope_sin[: h.shape[1]]
    torch.testing.assert_close(compiled(h, cos, sin), model.layers[0](h, cos, sin))
    assert torch.isfinite(eager)


def _run_of(ref: dict, scale: float = 0.0, nan: bool = False) -> dict:
    params = {k: v + scale for k, v in ref["params"].items()}
    if nan:
        params["output.weight"] = params["output.weight"].clone()
        params["output.weight"][0, 0] = float("nan")
    return {"losses": list(ref["losses"]), "norms": list(ref["norms"]), "params": params}


def test_compare_against_the_reference():
    ref = {"losses": [5.5, 5.4, 5.3], "norms": [1.0, 0.9, 0.8],
           "params": {"output.weight": torch.zeros(4, 3), "norm.weight": torch.ones(3)}}
    tol = sw.TOL["cpu"]
    same = sw.compare(ref, {r: _run_of(ref) for r in range(4)}, tol)
    assert same["ok"] and same["param_diff"] == 0 and same["ranks_diff"] == 0
    off = sw.compare(ref, {0: _run_of(ref, 1e-4), **{r: _run_of(ref) for r in (1, 2, 3)}}, tol)
    assert not off["ok"] and off["finite"] and off["param_diff"] == pytest.approx(1e-4, rel=1e-3)
    nan = sw.compare(ref, {r: _run_of(ref, nan=(r == 3)) for r in range(4)}, tol)  # only one rank: still caught
    assert not nan["ok"] and not nan["finite"] and nan["ranks_diff"] == math.inf
    loss = {r: _run_of(ref) for r in range(4)}
    loss[2]["losses"][1] = float("nan")
    assert not sw.compare(ref, loss, tol)["finite"]


# ---- the sanitizer's ranks with CUDA faked, the sync counter ------------------------------------------
def fake_cuda_rank_sanitized(payload: dict) -> dict:
    """``rank_sanitized`` on CPU: the CUDA calls faked (the stand-in and the mesh on the CPU, memory
    counters, the sanitizer on), the guard's read reported as a synchronisation while the sync
    debug mode is on, and a planted run ended by a sanitizer error, as CUDA's would be."""
    import contextlib
    from unittest import mock

    import torch.cuda._sanitizer as csan
    import torch.distributed.device_mesh as device_mesh

    from paro_fsdp.train import faults

    real_mesh, real_standin, real_guard = (
        device_mesh.init_device_mesh,
        standin.StandIn,
        faults.NonFiniteGuard.allows_step,
    )
    mode = [0]

    def guard(self, *args):
        if mode[0]:
            warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, faults.__file__, 111)
        return real_guard(self, *args)

    @contextlib.contextmanager
    def planted(name, device):
        if name:
            raise csan.CUDASanitizerErrors(["CSAN detected a possible data race on tensor with data pointer 1"])
        yield

    with mock.patch.object(sw, "rank_device", lambda kind: torch.device("cpu")), \
            mock.patch.object(device_mesh, "init_device_mesh", lambda kind, *a, **k: real_mesh("cpu", *a, **k)), \
            mock.patch.object(standin, "StandIn", lambda device, delay=0: real_standin("cpu", delay)), \
            mock.patch.object(sw, "planted", planted), mock.patch.object(faults.NonFiniteGuard, "allows_step", guard), \
            mock.patch.object(csan.cuda_sanitizer, "enabled", True), \
            mock.patch.multiple(torch.cuda, synchronize=lambda: None, reset_peak_memory_stats=lambda: None,
                                max_memory_allocated=lambda: 5 << 20, max_memory_reserved=lambda: 20 << 20,
                                set_sync_debug_mode=lambda m: mode.__setitem__(0, m)):
        return sw.rank_sanitized(payload)


def test_sanitized_ranks_with_cuda_faked():
    """The sanitizer tests' ranks end to end on CPU: every run exact, two guard reads per run and
    rank (steps 2 and 3), the memory beside it; a planted run's sanitizer error fails the world."""
    target = "test_gpu_check_streams:fake_cuda_rank_sanitized"
    runs = sw.run_cases("cpu", [{"id": s, "strategy": s} for s in ("NNN", "GGG")], target=target, timeout=300)
    ref = sw.reference("cpu")
    for cid, case in runs.items():
        assert sw.compare(ref, case, sw.TOL["cpu"])["ok"], cid
        for r in case.values():
            assert r["sanitizer"] and r["allocated"] == 5 << 20 and r["reserved"] == 20 << 20
            assert sw.classify_syncs([tuple(x) for x in r["syncs"]]) == {"expected": 2, "unexpected": 0, "sites": {}}
    with pytest.raises(RuntimeError, match="CUDASanitizerErrors: .*CSAN detected a possible data race"):
        sw.run_cases("cpu", [{"id": "IIG+missing-wait", "strategy": "IIG", "plant": "missing-wait"}], target=target)


def test_sanitized_bf16_pair_with_cuda_faked():
    """The plumbing of part (e)'s bf16 pair on CPU: GGG's masters sent cast train as IGG's pushed copy."""
    runs = sw.run_cases("cpu", list(sw.BF16_PAIR), target="test_gpu_check_streams:fake_cuda_rank_sanitized",
                        timeout=300)
    assert sw.same_training(runs["GGG+bf16"], runs["IGG+bf16"]) == []


def test_sync_counter_records_where_each_synchronisation_was_made():
    modes: list = []
    counter = sw.SyncCounter(1, 3, set_mode=modes.append)
    guard = "/somewhere/" + sw.GUARD_FILE

    def step(n: int, extra: bool = False) -> None:
        counter.hook(n)
        warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, guard, 111)
        if extra:
            warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "/x/paro_fsdp/optim.py", 80)
        warnings.warn_explicit("something else", UserWarning, "/x/y.py", 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step 0 is not counted (and must not leak out)
        step(0)
        step(1)
        step(2, extra=True)
        counter.hook(3)
    assert modes == ["warn", 0]
    got = sw.classify_syncs(counter.sites)
    assert got == {"expected": 2, "unexpected": 1, "sites": {"/x/paro_fsdp/optim.py:80": 1}}


@pytest.mark.parametrize("version, cuda, device, ok", [
    ("2.11.0+cu130", "13.0", "cuda", True), ("2.14.1", "12.8", "cuda", True), ("2.13.0+cpu", None, "cpu", True),
    ("2.13.0+cpu", None, "cuda", False), ("2.10.0+cu128", "12.8", "cuda", False), ("2.15.0", "13.0", "cuda", False),
    ("nightly", "13.0", "cuda", False)])
def test_version_row(version, cuda, device, ok):
    got = checks.version_check(version, cuda, ((2, 11), (2, 14)), device)
    assert got["ok"] == ok and (ok or got["why"])
    if version == "2.10.0+cu128":
        assert got["why"] == "torch 2.10 is outside 2.11..2.14"
