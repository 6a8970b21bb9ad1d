"""What CPU can prove about the CUDA + NCCL path users run: backend strings, the CUDA ordinal,
the order of device selection and process-group start, and that sharding frees the original
parameters (the whole unsharded model must not stay resident)."""
from __future__ import annotations

import contextlib
import gc
import itertools
import weakref
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from paro_fsdp import mesh as mesh_mod
from paro_fsdp.mesh import device_type_for_backend, local_cuda_index


@pytest.mark.parametrize("backend, device", [
    ("nccl", "cuda"), ("NCCL", "cuda"), ("cuda:nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"),
    ("cuda:nccl,cpu:gloo", "cuda"), ("gloo", "cpu"), ("cpu:gloo", "cpu"), ("fake", "cpu"),
])
def test_backend_string_picks_the_device(backend, device):
    assert device_type_for_backend(backend) == device


@pytest.mark.parametrize("local_rank, visible, ordinal", [(0, 8, 0), (5, 8, 5), (5, 1, 0), (7, 4, 3), (3, 2, 1)])
def test_local_rank_maps_onto_the_visible_gpus(monkeypatch, local_rank, visible, ordinal):
    """SLURM --gpus-per-task=1 shows each process one GPU while LOCAL_RANK counts 0..7."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert local_cuda_index(local_rank) == ordinal
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert local_cuda_index() == ordinal


def test_no_visible_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        local_cuda_index(0)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_init_selects_the_gpu_before_the_process_group_and_names_it(monkeypatch, backend):
    calls = []

    class Started(Exception):
        pass

    def init_process_group(name, **kwargs):
        calls.append(("init_process_group", name, kwargs.get("device_id")))
        raise Started

    monkeypatch.setenv("LOCAL_RANK", "6")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(mesh_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh_mod.dist, "init_process_group", init_process_group)
    with pytest.raises(Started):
        mesh_mod.init_paro_mesh(2, backend=backend)
    assert calls == [("set_device", torch.device("cuda", 2)), ("init_process_group", backend, torch.device("cuda", 2))]


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()
    mesh_mod._MESHES.clear()


@pytest.mark.parametrize("strategy", ["IIG", "GGG", "NNN", "ING", {"layers.*": "GGG", "default": "NIG"}])
def test_sharding_frees_every_original_parameter(fake_world, strategy):
    """After paro_shard of a model built on CPU, no original full parameter is alive (FSDP2
    frees them too): the engine keeps only shapes and names of what it replaced."""
    from torch.distributed.device_mesh import init_device_mesh

    from paro_fsdp import paro_shard
    from paro_fsdp.models.llama import Llama, LlamaArgs

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("inter", "intra"))
    model = Llama(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=16))
    originals = [weakref.ref(p) for p in model.parameters()]
    model = paro_shard(model, mesh, strategy)
    gc.collect()
    alive = [r() for r in originals if r() is not None]
    assert not alive, (
        f"{len(alive)} of {len(originals)} original parameters still alive, e.g. shape {tuple(alive[0].shape)}"
    )
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("strategy", ["IIG", "NNN", "NNG", "GGG", "ING"])
def test_memory_report_counts_master_gradients_and_boundary_temporaries(fake_world, strategy):
    """memory_report beside P, G, OS: the fp32 master gradients the boundary creates (counted
    here from the optimizer's own tensors: the parameters' fp32 .grad) and the full-size
    temporaries of G = N / P = N."""
    from torch.distributed.device_mesh import init_device_mesh

    from paro_fsdp import MixedPrecision, paro_shard
    from paro_fsdp.models.llama import Llama, LlamaArgs

    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=16)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("inter", "intra"))
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    model = paro_shard(Llama(args), mesh, strategy, mp=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (2, 9))).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    report = model.memory_report(opt)
    params = [p for group in opt.param_groups for p in group["params"]]
    grads = sum(p.grad.to_local().numel() * p.grad.element_size() for p in params)
    assert all(p.grad.dtype == torch.float32 for p in params)
    assert report["master_grads"] == grads > 0
    psi = sum(p.numel() for p in model.parameters())
    full = {"NNN": 2 * 2, "NNG": 2 * 2, "ING": 2 * 2, "IIG": 0, "GGG": 0}[strategy]  # cast to bf16 + FULL buffer
    assert report["boundary"] >= full * psi * 0.99  # padding makes FULL a little larger than psi
    groups = model._paro_state.groups
    assert report["G"] == sum(g.grad_acc.numel * 4 for g in groups)  # the fp32 accumulator
    assert report["in_flight"] > 0
    assert report["peak"] == report["total"] + report["master_grads"] + report["boundary"] + report["in_flight"]


class _Event:
    def __init__(self, n: int) -> None:
        self.n = n


class _Stream:
    """A CUDA stream's interface on CPU: logs the waits on it and numbers the events it records."""

    def __init__(self, name: str, log: list, numbers: Iterator[int]) -> None:
        self.name, self.log, self.numbers = name, log, numbers

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append((self.name, "waits for stream", other.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append((self.name, "waits for event", event.n))

    def record_event(self) -> _Event:
        event = _Event(next(self.numbers))
        self.log.append((self.name, "records", event.n))
        return event


@pytest.fixture
def fake_streams(monkeypatch):
    """torch.cuda's streams replaced by loggers: the compute stream is current until a side
    stream is entered."""
    log: list = []
    numbers = itertools.count()
    current = [_Stream("compute", log, numbers)]
    names = iter(["gather", "reduce"])  # CommStreams makes them in this order
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: _Stream(next(names), log, numbers))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "stream", on)
    return log


def test_parameter_gathers_wait_for_copy_outs_and_reductions_for_the_compute_stream(fake_streams):
    """Block i+1's parameter all-gather, issued (prefetch) right after block i's copy-out, waits
    for block i-1's copy-out event, never for the whole compute stream (which holds block i-1's
    compute); each result lives until a gather waited for its copy-out. Reductions and the
    boundary's gathers still wait for the compute stream, which wrote their input."""
    from paro_fsdp.streams import CommStreams

    log = fake_streams
    s = CommStreams(torch.device("cuda", 0))
    with s.issue("params"):  # no forward has marked the parameters written yet: the safe wait
        pass
    assert log == [("gather", "waits for stream", "compute")]
    del log[:]
    s.params_written()  # the root's pre-forward: after the optimizer's push
    assert log == [("gather", "waits for stream", "compute")]
    results = []
    for i in range(5):  # the forward: gather i (after copy-out i-1), then copy-out i
        del log[:]
        with s.issue("params") as side:
            assert torch.cuda.current_stream() is side is s.gather
            out = torch.empty(4)
        assert log == ([("gather", "waits for event", i - 2)] if i >= 2 else []), (i, log)
        assert [r() is not None for r in results] == [j >= i - 1 for j in range(i)], i
        s.copied_out(out)
        assert log[-1] == ("compute", "records", i)
        results.append(weakref.ref(out))
        del out
    del log[:]
    s.release()  # end of backward: the kept results go, after the gather stream waited for them
    assert log == [("gather", "waits for event", 3), ("gather", "waits for event", 4)]
    gc.collect()
    assert all(r() is None for r in results)
    for kind in ("reduce", "gather"):
        del log[:]
        with s.issue(kind) as side:
            assert side is getattr(s, kind)
        assert log == [(kind, "waits for stream", "compute")]


def test_the_engine_waits_for_the_compute_stream_once_per_forward(fake_world, fake_streams):
    """The wiring of the rule above into the engine (IIG on a fake 2 x 4 world, the streams
    replaced by loggers): in one forward the gather stream waits for the compute stream only at
    the root's pre-forward; every block's parameter gather after it waits on copy-out events."""
    from torch.distributed.device_mesh import init_device_mesh

    from paro_fsdp import paro_shard
    from paro_fsdp.models.llama import Llama, LlamaArgs
    from paro_fsdp.streams import CommStreams

    log = fake_streams
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("inter", "intra"))
    args = LlamaArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=16)
    model = paro_shard(Llama(args), mesh, "IIG")
    model._paro_state.comm.streams = CommStreams(torch.device("cuda", 0))
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 9)))
    gather_waits = [e for e in log if e[0] == "gather" and e[1].startswith("waits")]
    assert gather_waits[0] == ("gather", "waits for stream", "compute")  # the root's params_written
    assert [e for e in gather_waits[1:] if e[1] == "waits for stream"] == []
    assert sum(e[1] == "waits for event" for e in gather_waits) >= args.n_layers - 1
