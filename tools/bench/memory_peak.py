"""The engine's peak allocated bytes per rank during a training step, measured, beside what is
predicted: the cost model's peak (``cost.ledger.peak_of``, as ``cost.predict`` and the budgeted
auto price it), and ``memory_report()["peak"]`` + the activations (every term summed, as if at once).

Why: memory was computed (the ledger's formulas, checked against the engine's own counts), never
measured as allocated bytes at the peak; the budgeted ``auto`` keeps a plan within a budget only as
far as its prediction holds. How it is measured: on CUDA, ``torch.cuda.max_memory_allocated``
over the measured step (reset before it: the allocator's peak of all live tensors); on CPU,
torch.profiler's allocation events (``profile_memory=True``) from before the model is materialised
(built on the meta device, so every byte the engine holds is allocated inside the window), their
running sum, its largest value inside the measured step. The measured step is the second (the
optimizer's states exist), of ``--accum`` micro-steps with gradient sync on the last, torch's
``clip_grad_norm_`` and AdamW.

    python -m tools.bench.memory_peak [--nproc 4 --group-size 2] [--strategies IIG,GGG] [--seq-len 64]

Not a timing benchmark: a small model on local gloo ranks (``tools.local_world``).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

NAMED = ("NNN", "NNG", "NGG", "GGG", "III", "NIG", "IIG", "IGG", "ING")
STEP = "paro_measured_step"
_MESH: dict[str, Any] = {}


def _cpu_peak(prof: Any) -> tuple[float, float]:
    """(peak of the running sum of allocations inside the measured step, the sum when it started)."""
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int, int]] = []
    window: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        elif node.tag == _EventType.TorchOp and node.name == STEP:
            window.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    if len(window) != 1:
        raise RuntimeError(f"memory_peak: expected one {STEP!r} range in the profile, found {len(window)}")
    return running_peak(allocs, *window[0])


def running_peak(allocs: Sequence[tuple[int, int, int]], start: int, end: int) -> tuple[float, float]:
    """(the largest running sum of ``(time, +size or -size, address)`` events in [start, end], the sum at
    start). The profiler records only the frees of the threads it profiles, and gloo's threads release
    a collective's buffers: an address handed out again was freed first, so its earlier allocation
    leaves the sum then (without that, GGG's measured peak moved by 17% between runs)."""
    total, at_start, peak = 0, None, None
    live: dict[int, int] = {}
    for t, size, ptr in sorted(allocs):
        if t >= start and at_start is None:
            at_start = peak = total
        if size < 0 and live.pop(ptr, None) is None:
            continue  # freed, not allocated inside the profile: an earlier run's (its garbage collected now)
        if size > 0:
            total -= live.get(ptr, 0)  # its free went unrecorded
            live[ptr] = size
        total += size
        if start <= t <= end:
            peak = max(peak if peak is not None else total, total)
    at_start = total if at_start is None else at_start
    return float(peak if peak is not None else at_start), float(at_start)


def _one(strategy: str, payload: dict) -> dict:
    """One strategy on this rank: build, two steps, the second measured."""
    from functools import partial

    import torch
    import torch.distributed as dist

    from paro_fsdp import init_paro_mesh, paro_shard
    from paro_fsdp.models.llama import Llama, flavor

    cuda = torch.cuda.is_available() and payload.get("cuda", False)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args = flavor(payload["flavor"], max_seq_len=payload["seq_len"], **payload.get("overrides", {}))
    if "mesh" not in _MESH:  # one mesh per rank process, for every strategy
        _MESH["mesh"] = init_paro_mesh(payload["group_size"])
    mesh = _MESH["mesh"]
    rank = dist.get_rank()
    mb, seq, accum = payload["micro_batch"], payload["seq_len"], payload["accum"]
    data = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, args.vocab_size, (mb, seq + 1), generator=data).to(device) for _ in range(2 * accum)]

    def run() -> tuple[Any, Any]:
        with torch.device("meta"):
            model = Llama(args)
        if payload.get("checkpoint"):
            from paro_fsdp.train.parallelize import apply_activation_checkpointing

            apply_activation_checkpointing(model)
        model = paro_shard(model, mesh, strategy, param_init_fn=partial(model.init_param, seed=0))
        model.init_buffers(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def step(k: int) -> None:
            for micro in range(accum):
                model.set_requires_gradient_sync(micro == accum - 1)
                (model(batches[k * accum + micro]).loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        step(0)
        return model, opt, step

    if cuda:
        model, opt, step = run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(1)
        torch.cuda.synchronize()
        peak, base = float(torch.cuda.max_memory_allocated()), 0.0
    else:
        import gc

        from torch.profiler import ProfilerActivity, profile, record_function

        gc.collect()  # an earlier strategy's engine (reference cycles) is not freed inside this one's window
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model, opt, step = run()
            with record_function(STEP):
                step(1)
        peak, base = _cpu_peak(prof)
    report = model.memory_report(opt)
    del model, opt
    return {"strategy": strategy, "measured": peak, "before_step": base, "report": report}


def _rank_main(payload: dict) -> list[dict]:
    return [_one(s, payload) for s in payload["strategies"]]


def predictions(strategies: Sequence[str], nproc: int, group: int, flavor_name: str, micro_batch: int, seq_len: int,
                accum: int, checkpoint: bool = False) -> dict[str, dict[str, float]]:
    """Per strategy: the cost model's activation peak and predicted peak per rank (fp32, CPU)."""
    import torch

    from paro_fsdp.api import _default_blocks
    from paro_fsdp.cost.budget import Workload, plan_blocks, spec_of, units_of
    from paro_fsdp.cost.cluster import load_cluster
    from paro_fsdp.cost.model import activation_bytes
    from paro_fsdp.models.llama import Llama, flavor

    with torch.device("meta"):
        model = Llama(flavor(flavor_name, max_seq_len=seq_len))
    work = Workload(micro_batch, seq_len, accum, checkpoint)
    spec = spec_of(model, work)
    plan = plan_blocks(units_of(model, _default_blocks(model)), nproc, group, None, load_cluster("a100_ib"), work,
                       spec, 4, 4, 4, strategies=strategies)
    acts = activation_bytes(spec, micro_batch, seq_len, 4, checkpoint)["peak"]
    return {s: {"activations": acts, "footprint": f} for s, f, _ in plan.single}


def table(results: list[dict], pred: dict[str, dict[str, float]]) -> str:
    MiB = 2**20
    head = (f"{'strat':5} {'measured MiB':>12} {'max rank':>8} {'report+acts':>11} {'meas/that':>9} {'predicted':>9} "
            f"{'meas/pr':>7} | {'P':>6} {'G':>6} {'OS':>6} {'master':>6} {'bound':>6} {'flight':>6} {'acts':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        p, rep = pred[r["strategy"]], r["report"]
        that = rep["peak"] + p["activations"]
        lines.append(f"{r['strategy']:5} {r['measured'] / MiB:12.3f} {r['largest'] / MiB:8.3f} {that / MiB:11.3f} "
                     f"{r['measured'] / that:9.2f} "
                     f"{p['footprint'] / MiB:9.3f} {r['measured'] / p['footprint']:7.2f} | "
                     + " ".join(f"{rep[k] / MiB:6.2f}" for k in ("P", "G", "OS", "master_grads", "boundary",
                                                                  "in_flight"))
                     + f" {p['activations'] / MiB:6.2f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.memory_peak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--strategies", default=",".join(NAMED))
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing on every layer (the trainer's)")
    ap.add_argument("--cuda", action="store_true", help="ranks on GPU 0 (torch.cuda.max_memory_allocated)")
    a = ap.parse_args(argv)
    if a.nproc % a.group_size:
        print(f"memory_peak: error: --group-size {a.group_size} does not divide --nproc {a.nproc}", file=sys.stderr)
        return 2
    from paro_fsdp.strategy import Strategy
    from tools.local_world import run_local_world

    try:
        strategies = [Strategy.parse(s).name for s in a.strategies.split(",")]
    except ValueError as exc:
        print(f"memory_peak: error: --strategies: {exc}", file=sys.stderr)
        return 2
    payload = {"strategies": strategies, "group_size": a.group_size, "flavor": a.flavor, "micro_batch": a.micro_batch,
               "seq_len": a.seq_len, "accum": a.accum, "cuda": a.cuda,
               "checkpoint": a.checkpoint}
    per_rank = run_local_world(a.nproc, "tools.bench.memory_peak:_rank_main", payload,
                               device="cuda" if a.cuda else "cpu")
    # the median rank (the upper one): when gloo's threads free a collective's buffers moves a rank's peak
    results = [dict(sorted((rank[i] for rank in per_rank), key=lambda r: r["measured"])[len(per_rank) // 2],
                    largest=max(rank[i]["measured"] for rank in per_rank)) for i in range(len(strategies))]
    pred = predictions(strategies, a.nproc, a.group_size, a.flavor, a.micro_batch, a.seq_len, a.accum, a.checkpoint)
    print(f"{a.flavor} Llama, fp32, micro-batch {a.micro_batch} x {a.seq_len}, {a.accum} micro-steps, {a.nproc} ranks "
          f"= {a.nproc // a.group_size} groups x {a.group_size}; the median rank's peak; MiB per rank")
    print(table(results, pred))
    return 0


if __name__ == "__main__":
    sys.exit(main())
