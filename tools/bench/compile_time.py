"""How long torch.compile makes the first training step, PaRO against FSDP2 + per-block compile,
on the trainer's debug model and batch (4 CPU gloo ranks as 2 groups x 2), cold and warm.

    python -m tools.bench.compile_time                       # IIG, scope model and blocks, FSDP2
    python -m tools.bench.compile_time --variants paro-blocks,fsdp2 --strategy GGG

Why: compiling pays only if the first step does not eat the gain (the bar: cold within 2x of
FSDP2 + per-block compile, warm within 15 s). Each variant runs in fresh processes twice over one
inductor cache folder (PaRO: per-rank graph caches, shared kernels, as the trainer makes them): "cold" starts from an
empty folder, "warm" from what the cold run left, as a restarted job would. Variants run one
after another, never side by side, so no variant reuses another's kernels. Per variant: the
first (compiling) step and the second step, seconds, the slowest rank; the graphs dynamo compiled
and its recompilations; inductor's FX-graph cache hits and misses (the warm run must hit).

Variants: ``paro-model`` (the whole model compiled, the graph passes on: the trainer's
``compile.scope = "model"``), ``paro-blocks`` (each transformer block on its own, as the
trainer does through ``passes.compile_model``: identical blocks make identical
graphs, so all but the first hit the cache), ``fsdp2``
(``fully_shard`` per block and the root, each block compiled, ZeRO-3 over the 4 ranks).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paro_fsdp.models.llama import FLAVORS, LlamaArgs
from tools.local_world import run_local_world

from .workload import GROUP, LR, MAX_NORM, WD, WORLD, make_model, reduce_max

VARIANTS = ("paro-model", "paro-blocks", "fsdp2")


@dataclass(frozen=True)
class Config:
    args: LlamaArgs
    batch: int
    seq: int
    strategy: str
    variants: tuple[str, ...]
    breakdown: bool = False  # print rank 0's compile time per phase (dynamo's compile_times)
    push_graph: bool = False  # compile the push to P after each optimizer step (compile_model(push=True))


def _tokens(cfg: Config, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, cfg.args.vocab_size, (cfg.batch, cfg.seq + 1), generator=gen)


def _build(cfg: Config, variant: str):
    """(forward callable, clip, optimizer) of ``variant``, compiled as the trainer compiles."""
    model = make_model(cfg.args)
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
            layer.compile()
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
        return model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM), opt

    import passes
    from paro_fsdp import init_paro_mesh, paro_shard

    model = paro_shard(model, init_paro_mesh(GROUP), cfg.strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    blocks = variant != "paro-model"  # per block, the engine's hooks in each block's graph, as the trainer
    passes.compile_model(model, scope="blocks" if blocks else "model", push=cfg.push_graph,
                         **({"fullgraph": True} if blocks else {}))
    model.set_requires_gradient_sync(True)  # A = 1: every micro-step is the last one
    return model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM), opt


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "frames": int(counters["frames"]["ok"]),
            "fx_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fx_miss": int(counters["inductor"]["fxgraph_cache_miss"])}


def _rank_main(job: tuple[Config, str]) -> dict:
    """One rank of a run (``tools.local_world``): rank 0's times and counters, the others' {}."""
    cfg, variant = job
    rank, out = dist.get_rank(), {}
    model, clip, opt = _build(cfg, variant)  # passes.compile_model gives each rank its own cache folder
    times, frames = [], []
    for step in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        model(_tokens(cfg, rank, step)).loss.backward()
        clip()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        frames.append(_counters()["frames"])
    times = reduce_max(times)
    counts = _counters()
    counts["recompiles"] = frames[1] - frames[0]  # frames dynamo compiled again in the second step
    if rank == 0:
        out.update(first=times[0], second=times[1], **counts)
        if cfg.breakdown:
            from torch._dynamo.utils import compile_times

            print(f"rank 0 compile times by phase (s):\n{compile_times(repr='str', aggregate=True)}", flush=True)
    return out


def run_variant(cfg: Config, variant: str, cache: str) -> dict:
    """One fresh 4-rank run of ``variant`` over the inductor cache folder ``cache``."""
    return run_local_world(WORLD, "tools.bench.compile_time:_rank_main", (cfg, variant), timeout=3600,
                           env={"TORCHINDUCTOR_CACHE_DIR": cache})[0]


def table(cfg: Config, rows: dict[tuple[str, str], dict]) -> str:
    a = cfg.args
    lines = [f"debug-size Llama: dim {a.dim} x {a.n_layers} layers, vocab {a.vocab_size}; batch {cfg.batch} x "
             f"{cfg.seq}; {WORLD} gloo ranks ({WORLD // GROUP} x {GROUP}); PaRO {cfg.strategy}; A = 1",
             f"{'variant':<13}{'run':<6}{'1st step s':>11}{'vs fsdp2':>9}{'2nd step s':>11}{'graphs':>8}"
             f"{'recompiles':>11}{'fx hits':>8}{'fx misses':>10}"]
    for (variant, run), r in rows.items():
        base = rows.get(("fsdp2", run))
        ratio = f"{r['first'] / base['first']:.2f}" if base else "-"
        lines.append(f"{variant:<13}{run:<6}{r['first']:>11.1f}{ratio:>9}{r['second']:>11.2f}{r['graphs']:>8}"
                     f"{r['recompiles']:>11}{r['fx_hit']:>8}{r['fx_miss']:>10}")
    lines.append("1st step: the compiling step, slowest rank (cold: an empty inductor cache folder, all 4 ranks "
                 "compiling on the shared cores; warm: new processes over the cold run's caches); recompiles: frames "
                 "dynamo compiled in the second step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--strategy", default="IIG", help="PaRO strategy (default IIG, the debug config's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--breakdown", action="store_true", help="print rank 0's compile time per phase")
    ap.add_argument(
        "--push-graph", action="store_true",
        help="PaRO: compile the push to P after each optimizer step too (compile_model's push=True)"
    )
    ap.add_argument("--cold-only", action="store_true")
    ns = ap.parse_args(argv)
    variants = tuple(v for v in ns.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    cfg = Config(FLAVORS["debug"], ns.batch, ns.seq, ns.strategy.upper(), variants, ns.breakdown, ns.push_graph)
    rows: dict[tuple[str, str], dict] = {}
    for variant in variants:
        with tempfile.TemporaryDirectory(prefix="paro-compile-time-") as cache:
            for run in ("cold",) if ns.cold_only else ("cold", "warm"):
                rows[(variant, run)] = run_variant(cfg, variant, cache)
                print(f"{variant} {run}: {rows[(variant, run)]}", flush=True)
    print(table(cfg, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
