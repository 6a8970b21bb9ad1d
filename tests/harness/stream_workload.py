"""What the stream tests (tests/test_gpu_streams.py, tests/test_gpu_sanitizer.py) train and plant,
on four ranks sharing one device as a 2 x 2 mesh, every collective through the stand-in kernels
(``standin.py``): a small Llama with an uneven vocabulary, its data, the single-process
reference, the stalls that make the compute stream lag the host on CUDA, the bugs planted on
purpose, and the ranks' functions.

The vocabulary has 258 rows, which 4 ranks do not divide, so the embedding and the output layer
take the engine's uneven-shard (index) path; everything else divides. Every run is 3 optimizer
steps of 2 accumulated micro-steps (AdamW, clipping at 0.5 so the clip scales), from the same
seeded CPU init; rank r's micro-batch of (step, micro) is the same on every device, and the
reference trains on the four ranks' micro-batches side by side.

The planted bugs prove that the tests fail when the engine's stream protocol is broken:
* ``missing-wait``: the consumer does not wait for a collective. ``comm.Pending.wait`` returns its
  tensor as it is (on CPU without ``wait_tensor``, on CUDA without making the consumer's stream
  wait for the side stream's event), and ``streams.CommStreams.wait`` does nothing (on CUDA the
  consumer's wait of every PaRO-CC result too); on CPU, where PaRO-CC waits each phase on the
  host, its phases skip ``wait_tensor`` (``paro_cc.wait``, ``comm.wait``). The stand-in then hands the consumer
  a poisoned (NaN) buffer: on CPU always, on CUDA while its result stream still sleeps. (NNN and
  GGG move everything through PaRO-CC; the clip's all-reduce, which once caught them on CPU, is
  DTensor's now: torch's ``clip_grad_norm_`` over the parameters.)
* ``issue-wait`` (CUDA only: CPU has no streams): ``streams.CommStreams.issue`` enters the side
  stream without making it wait for the compute stream first, so a collective reads its input
  (a gradient, the clipped masters) before the lagging compute stream has written it.
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import torch

ARGS = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, ffn_dim=48, max_seq_len=32)
SEED, B, T, STEPS, ACCUM, LR, WEIGHT_DECAY, MAX_NORM = 0, 2, 8, 3, 2, 1e-3, 0.1, 0.5
WORLD = 4  # a 2 x 2 mesh ("inter", "intra")


# ---- the compute stream's stall: an op that sleeps on CUDA, in forward and in backward --------------
@torch.library.custom_op("paro_gpu_check::delay", mutates_args=())
def delay(x: torch.Tensor, cycles: int) -> torch.Tensor:
    """``x`` (a copy), after ``torch.cuda._sleep(cycles)`` on the current stream (CUDA only; on
    CPU just the copy). A custom op so it stays in compiled graphs; its backward sleeps too."""
    if x.is_cuda and cycles > 0:
        torch.cuda._sleep(cycles)
    return x.clone()


@delay.register_fake
def _delay_fake(x: torch.Tensor, cycles: int) -> torch.Tensor:
    return torch.empty_like(x)


def _delay_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.cycles = inputs[1]


def _delay_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return delay(grad, ctx.cycles), None


delay.register_autograd(_delay_backward, setup_context=_delay_setup)


def add_delays(model: torch.nn.Module, cycles: int) -> None:
    """Stall the compute stream where a missing wait would show: after the token embedding and
    after every block's feed-forward, so in backward every gradient of a block (and the root's
    embedding gradient) is computed behind a sleep queued after the last collective the host
    waited for, and a reduction issued without waiting for the compute stream reads it too early.
    In forward the same sleeps delay the blocks behind their gathers."""
    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return delay(out, cycles)

    model.tok_embeddings.register_forward_hook(hook)
    for layer in model.layers:
        layer.feed_forward.register_forward_hook(hook)


def stall(device: torch.device, cycles: int) -> None:
    """Sleep on the current CUDA stream (nothing on CPU): before clipping and before the step, whose
    collectives read what the compute stream just wrote."""
    if device.type == "cuda" and cycles > 0:
        torch.cuda._sleep(cycles)


def cycles_per_ms(device: torch.device, tries: int = 3) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU, measured with events; the
    best of ``tries`` (other processes time-sliced onto the GPU only ever make a sleep look longer)."""
    n, best = 1_000_000, 0.0
    torch.cuda._sleep(n)  # warm-up
    for _ in range(tries):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        best = max(best, n / max(start.elapsed_time(end), 1e-3))
    return best


# ---- model, data, reference ---------------------------------------------------------------------------
def make_model() -> torch.nn.Module:
    from paro_fsdp.models.llama import Llama, LlamaArgs

    torch.manual_seed(SEED)
    return Llama(LlamaArgs(**ARGS))


def batch(rank: int, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, ARGS["vocab_size"], (B, T + 1), generator=gen)


def exact_math() -> None:
    """No TF32 anywhere: the runs are compared to float32 tolerances."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def reference(device: str, world: int = WORLD) -> dict[str, Any]:
    """One process, the global batch of every micro-step = every rank's micro-batch side by side:
    per-step losses and gradient norms, and the final parameters (on the CPU)."""
    exact_math()
    dev = torch.device(device)
    model = make_model().to(dev)  # buffers computed on the CPU and moved, as paro_shard moves them
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for a in range(ACCUM):
            x = torch.cat([batch(r, step, a) for r in range(world)]).to(dev)
            loss = model(x).loss / ACCUM
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().float().cpu() for n, p in model.named_parameters()}}


# ---- one sharded run (inside a rank) ------------------------------------------------------------------
def compile_first_block(model: torch.nn.Module, device: str) -> Any:
    """``torch.compile`` of ``layers.0`` as ``passes.compile_model`` compiles blocks
    (fullgraph, the graph passes): inductor on CUDA, the passes' AOTAutograd backend on CPU (no
    codegen: seconds instead of a minute). Returns the passes' record: every graph with
    collectives, before and after the passes."""
    import torch.distributed as dist

    import passes
    from paro_fsdp._compat import isolate_compile_cache
    from paro_fsdp.traced import _compile_block

    isolate_compile_cache(dist.get_rank())
    torch._inductor.config.force_disable_caches = True  # a cache hit would skip the passes (and the record)
    if device == "cuda":
        record = passes.install(passes.ORDER, meshes=[model.paro_mesh_groups()])
        torch._inductor.config.compile_threads = 2  # four ranks compile at once, beside part (a)'s compiled run
        backend: Any = "inductor"
    else:
        record = passes.ParoPasses(passes.ORDER, meshes=[model.paro_mesh_groups()])
        backend = passes.aot_backend(record)
    _compile_block(model.layers[0], backend=backend, fullgraph=True)  # the engine's hooks in the block's graph
    return record


def graph_collectives(record: Any) -> dict[str, int]:
    """{phase kind/dim: count} over every graph the passes saw (after the passes)."""
    out: dict[str, int] = {}
    for r in record.records:
        for e in r.after:
            key = f"{r.phase} {e.kind}/{e.dim}"
            out[key] = out.get(key, 0) + 1
    return out


def train_sharded(mesh: Any, strategy: str, device: torch.device, *, delay_cycles: int = 0, stall_cycles: int = 0,
                  compiled: bool = False, step_hook: Optional[Callable[[int], None]] = None,
                  guard: Any = None, bf16: bool = False) -> dict[str, Any]:
    """``strategy`` on ``mesh``: the workload's 3 steps; returns this rank's per-step losses (its
    own micro-batches), the gradient norms, the final full parameters (on the CPU) and, when
    ``compiled``, the collectives in the compiled block's graphs. ``step_hook(step)`` runs before
    each step (part (e) turns the sync debug mode on there); ``guard``: a trainer
    ``NonFiniteGuard`` that decides whether the optimizer steps, as in ``train.py``; ``bf16``: P in
    bf16 (where P = OS, the gathers send the fp32 masters cast, on the gather stream)."""
    import torch.distributed as dist

    from paro_fsdp import MixedPrecision, paro_shard

    exact_math()
    if compiled:
        torch._dynamo.reset()  # before paro_shard: a reset drops the compile-start callback that makes its sinks
    model = paro_shard(make_model(), mesh, strategy, mp=MixedPrecision(torch.bfloat16) if bf16 else None)
    add_delays(model, delay_cycles)
    record = compile_first_block(model, device.type) if compiled else None
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    rank = dist.get_rank()
    data = [[batch(rank, s, a).to(device) for a in range(ACCUM)] for s in range(STEPS)]
    losses, norms = [], []
    for step in range(STEPS):
        if step_hook is not None:
            step_hook(step)
        total = torch.zeros((), device=device)
        for a in range(ACCUM):
            model.set_requires_gradient_sync(a == ACCUM - 1)  # the boundary's reductions under the last backward
            loss = model(data[step][a]).loss / ACCUM
            loss.backward()
            total += loss.detach()
        stall(device, stall_cycles)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor()
        stall(device, stall_cycles)
        if guard is None or guard.allows_step(step + 1, total, norm, opt):
            opt.step()
        opt.zero_grad()
        losses.append(total)
        norms.append(norm)
    model.wait_for_params()  # the last step's pushes to P, which a next forward would have waited for
    if step_hook is not None:
        step_hook(STEPS)
    out = {"losses": [float(x) for x in losses], "norms": [float(x) for x in norms],
           "params": {n: p.full_tensor().detach().float().cpu() for n, p in model.named_parameters()}}
    if record is not None:
        out["graph_collectives"] = graph_collectives(record)
        if device.type == "cuda":
            import passes

            passes.uninstall()
    return out


def _worst(values: list[float]) -> float:
    """The largest value; inf when any is NaN or infinite (Python's max skips NaN by accident)."""
    return math.inf if any(not math.isfinite(v) for v in values) else max(values, default=0.0)


def compare(ref: dict[str, Any], ranks: dict[int, dict[str, Any]], tol: tuple[float, float, float]) -> dict[str, Any]:
    """One case of every rank against the reference: the loss of each step (the mean of the ranks'
    own losses), rank 0's gradient norms, rank 0's final parameters (max abs difference), and every
    rank's parameters against rank 0's. ``tol``: (loss rel, norm rel, parameter abs)."""
    loss_rtol, norm_rtol, atol = tol
    n = len(ranks)
    first = ranks[min(ranks)]
    losses = [sum(r["losses"][i] for r in ranks.values()) / n for i in range(len(ref["losses"]))]
    loss_rel = _worst([abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref["losses"])])
    norm_rel = _worst([abs(a - b) / max(abs(b), 1e-12) for a, b in zip(first["norms"], ref["norms"])])
    diffs = {name: float((first["params"][name] - value).abs().max()) for name, value in ref["params"].items()}
    param_diff = _worst(list(diffs.values()))
    worst = max(diffs, key=lambda k: diffs[k] if math.isfinite(diffs[k]) else math.inf, default="")
    ranks_diff = _worst([float((r["params"][k] - first["params"][k]).abs().max()) for r in ranks.values()
                         for k in first["params"]])
    finite = (
        all(math.isfinite(v) for v in losses + first["norms"])
        and math.isfinite(param_diff)
        and math.isfinite(ranks_diff)
    )
    ok = finite and loss_rel <= loss_rtol and norm_rel <= norm_rtol and param_diff <= atol and ranks_diff <= atol
    return {"ok": ok, "finite": finite, "loss_rel": loss_rel, "norm_rel": norm_rel, "param_diff": param_diff,
            "worst_param": worst, "ranks_diff": ranks_diff, "losses": losses}


# ---- the planted bugs ----------------------------------------------------------------------------
PLANTS = ("missing-wait", "issue-wait")
CUDA_ONLY = ("issue-wait",)  # CPU has no streams


def _pending_without_wait(self: Any) -> Any:
    return self.tensor


@contextlib.contextmanager
def _issue_without_wait(self: Any, kind: str) -> Iterator[Any]:
    side = self.stream(kind)
    with torch.cuda.stream(side):
        yield side


@contextlib.contextmanager
def planted(name: Optional[str], device: str) -> Iterator[None]:
    """Run the body with the bug ``name`` planted in the engine (nothing for None)."""
    if name is None:
        yield
        return
    if name not in PLANTS or (name in CUDA_ONLY and device != "cuda"):
        raise ValueError(
            f"plant {name!r} on {device}: valid "
            f"{', '.join(p for p in PLANTS if device == 'cuda' or p not in CUDA_ONLY)}"
        )
    from paro_fsdp import comm, paro_cc, streams

    with contextlib.ExitStack() as stack:
        if name == "missing-wait":
            stack.enter_context(mock.patch.object(comm.Pending, "wait", _pending_without_wait))
            stack.enter_context(mock.patch.object(streams.CommStreams, "wait", staticmethod(lambda event: None)))
            if device != "cuda":  # on CUDA the side streams' waits above are the consumer's
                stack.enter_context(mock.patch.object(paro_cc, "wait", lambda t: t))
        else:
            stack.enter_context(mock.patch.object(streams.CommStreams, "issue", _issue_without_wait))
        yield


# ---- inside a rank ----------------------------------------------------------------------------------
#: on CUDA: the compute stream's stall (each delay op, before clipping and before the step) and
#: how long every collective's result waits behind a sleep. The result delay must exceed the
#: compute stream's lag between a collective's wait and its consumer (at most a stall and a tiny
#: block): 4x. Both are short because four processes time-slice one GPU: ~140 results per GGG run
DELAY_MS, RESULT_MS = 0.5, 2.0
#: against the single-process reference: (loss rel, grad norm rel, parameter abs). CPU: the
#: tolerances of the 4-rank CPU tests; CUDA: the reference runs on the same GPU, but with other
#: GEMM shapes (4x the batch), so a little looser -- still far below what one stale or poisoned
#: buffer does (NaN, or AdamW steps of ~1e-3 in the wrong direction)
TOL = {"cpu": (1e-5, 1e-5, 2e-5), "cuda": (1e-4, 1e-4, 1e-4)}
# bf16 P: GGG gathers the fp32 masters cast (P = OS), IGG a pushed bf16 copy; otherwise the same
# moves, so the same training bit for bit
BF16_PAIR = ({"id": "GGG+bf16", "strategy": "GGG", "bf16": True}, {"id": "IGG+bf16", "strategy": "IGG", "bf16": True})


def same_training(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> list[str]:
    """What differs between two cases' per-rank results (losses, norms, final parameters)."""
    bad = []
    for rank in a:
        for key in ("losses", "norms"):
            if a[rank][key] != b[rank][key]:
                bad.append(f"rank {rank} {key}")
        bad += [f"rank {rank} {n}" for n, v in a[rank]["params"].items() if not torch.equal(v, b[rank]["params"][n])]
    return bad


def rank_device(kind: str) -> torch.device:
    """The device this rank runs on: GPU 0 for every rank (one GPU), or the CPU."""
    if kind == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.init()
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _mesh(device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (2, 2), mesh_dim_names=("inter", "intra"))


def rank_cases(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every case of ``payload["cases"]`` ({id, strategy, compiled, plant, bf16}) on this rank, through
    the stand-in (on CUDA behind its result delay, the compute stream stalled): per case the
    result of ``train_sharded``, what the stand-in served and the seconds it took."""
    from standin import StandIn

    device = rank_device(payload["device"])
    mesh = _mesh(device)
    cpm = cycles_per_ms(device) if device.type == "cuda" else 0.0
    standin = StandIn(device.type, int(RESULT_MS * cpm)).install()
    out = {}
    for case in payload["cases"]:
        t0, before = time.monotonic(), standin.stats.snapshot()
        with planted(case.get("plant"), device.type):
            got = train_sharded(mesh, case["strategy"], device, delay_cycles=int(DELAY_MS * cpm),
                                stall_cycles=int(DELAY_MS * cpm), compiled=case.get("compiled", False),
                                bf16=case.get("bf16", False))
        out[case["id"]] = {"seconds": time.monotonic() - t0, "standin": standin.stats.since(before), **got}
    return out


GUARD_FILE = "paro_fsdp/train/faults.py"  # NonFiniteGuard.allows_step: the one expected synchronisation
SYNC_FROM_STEP = 1  # 0-based: from the second step on (the first allocates, compiles nothing, warms up)
SYNC_MESSAGE = "synchronizing CUDA operation"


class SyncCounter:
    """Turns the sync debug mode on at step ``from_step`` (``hook(step)`` is called before each
    step and once after the last) and records where each synchronising call was made."""

    def __init__(self, from_step: int, last_step: int, set_mode: Optional[Callable[[Any], None]] = None) -> None:
        self.from_step, self.last_step = from_step, last_step
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self._catch: Any = None
        self._log: list[Any] = []
        self.sites: list[tuple[str, int]] = []

    def hook(self, step: int) -> None:
        if step == self.from_step:
            self._catch = warnings.catch_warnings(record=True)
            self._log = self._catch.__enter__()
            warnings.simplefilter("always")
            self.set_mode("warn")
        elif step == self.last_step and self._catch is not None:
            self.set_mode(0)
            self._catch.__exit__(None, None, None)
            self._catch = None
            self.sites = [(w.filename, w.lineno) for w in self._log if SYNC_MESSAGE in str(w.message)]


def classify_syncs(sites: list[tuple[str, int]], expected_file: str = GUARD_FILE) -> dict[str, Any]:
    """Synchronising calls (each at the Python ``(file, line)`` that made it) split into the
    expected ones (made in ``expected_file``, a path suffix) and the others, counted by site."""
    expected, other = 0, {}
    for filename, line in sites:
        if filename.replace("\\", "/").endswith(expected_file):
            expected += 1
        else:
            key = f"{filename}:{line}"
            other[key] = other.get(key, 0) + 1
    return {"expected": expected, "unexpected": sum(other.values()), "sites": other}


def rank_sanitized(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The sanitizer's cases on this rank (``TORCH_CUDA_SANITIZER=1`` set before the rank imported
    torch): each case trained with the trainer's non-finite guard, the sync debug mode on from
    ``SYNC_FROM_STEP``; per case the result, where it synchronised, the peak allocated and
    reserved bytes. A sanitizer error propagates: it fails the world (the other ranks may be
    stuck behind the racing one)."""
    from standin import StandIn
    from torch.cuda import _sanitizer as csan

    from paro_fsdp.train.faults import NonFiniteGuard

    device = rank_device("cuda")
    mesh = _mesh(device)
    StandIn("cuda").install()
    out = {}
    for case in payload["cases"]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        counter = SyncCounter(SYNC_FROM_STEP, STEPS)
        try:
            with planted(case.get("plant"), "cuda"):
                got = train_sharded(mesh, case["strategy"], device, step_hook=counter.hook,
                                    guard=NonFiniteGuard("skip", 0), bf16=case.get("bf16", False))
        except csan.CUDASanitizerErrors as exc:  # its message is a count: name the first race
            raise RuntimeError(f"CUDASanitizerErrors: {str(exc.errors[0]).strip()[:600]}") from exc
        out[case["id"]] = {"sanitizer": bool(csan.cuda_sanitizer.enabled), "syncs": counter.sites,
                           "allocated": torch.cuda.max_memory_allocated(),
                           "reserved": torch.cuda.max_memory_reserved(), **got}
    return out


def run_cases(device: str, cases: list[dict[str, Any]], target: str = "stream_workload:rank_cases",
              env: Optional[dict[str, str]] = None, timeout: float = 600) -> dict[str, dict[int, dict[str, Any]]]:
    """``cases`` on four ranks sharing ``device`` (``tools.local_world``: spawned on CUDA);
    {case id: {rank: its result}}."""
    from tools.local_world import run_local_world

    per_rank = run_local_world(WORLD, target, {"device": device, "cases": cases}, timeout, device=device, env=env)
    return {c["id"]: {r: per_rank[r][c["id"]] for r in range(WORLD)} for c in cases}
