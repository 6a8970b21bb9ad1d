"""Eager vs torch.compile vs torch.compile + our graph passes, and FSDP2 + torch.compile, on 4
CPU gloo ranks (2 groups x 2): step-time ratios, and cold / warm compile times.

    .venv/bin/python -m tools.bench.compiled                      # GGG and III: ~12 min on 2 cores
    .venv/bin/python -m tools.bench.compiled --strategies GGG IIG NGG --rounds 6

Why: compiling should pay for itself. The targets: PaRO compiled with the passes is faster than
PaRO eager for every strategy measured, and not slower than FSDP2 + torch.compile on the
equivalent strategy (GGG = ZeRO-3 ``fully_shard``, III = HSDP on a 2D mesh). FSDP2's hooks are
dynamo-disabled, so its compiled graphs hold no collectives and it overlaps them eagerly; PaRO's
collectives are in the graph, ordered by passes/.

Every compiled variant compiles the whole model (``torch.compile(model)``, inductor) so that the
reorder pass sees every block in one graph; PaRO's also runs the accumulation boundary in graphs
(``set_requires_gradient_sync`` on the last micro-step, ``passes.compile_model``: the push to P too).
Every PaRO variant trains the FSDP2 way: torch's AdamW over ``model.parameters()``, torch's
``clip_grad_norm_``, ``set_requires_gradient_sync(a == A - 1)`` before each micro-step.
The model, data and optimizer are those of ``tools.bench.vs_fsdp2`` (``workload.py``). Each
variant's first step compiles it ("cold", with an empty inductor cache in a temporary folder, all
four ranks compiling at once on the shared cores; with A > 1 the last micro-step's graphs compile
in that step too; FSDP2 HSDP's compute graphs equal ZeRO-3's, so they come from the cache); then
the variants run interleaved rounds (order rotated every round) and the table shows the median
over rounds of the slowest rank's step. At the end one variant is compiled again after
``torch._dynamo.reset()`` ("warm": inductor's FX-graph cache hits; the passes' uuid is in its
key). The loss column is a sanity check: all PaRO variants and FSDP2 train the same model on the
same data, so their losses agree to float tolerance.
"""
from __future__ import annotations

import argparse
import sys
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import passes
from paro_fsdp import init_paro_mesh, paro_shard
from paro_fsdp.models.llama import LlamaArgs
from paro_fsdp._compat import isolate_compile_cache
from tools.local_world import run_local_world

from .workload import (GROUP, LR, MAX_NORM, WD, WORLD, add_model_args, batch_for, make_model, model_args_from,
                       reduce_max, reduce_mean)

FSDP2_EQUIVALENT = {"GGG": "fsdp2-zero3", "III": "fsdp2-hsdp"}


@dataclass(frozen=True)
class Config:
    args: LlamaArgs
    batch: int
    seq: int
    accum: int
    rounds: int
    strategies: tuple[str, ...]


@dataclass
class Variant:
    name: str  # "GGG eager", "GGG compiled", "GGG compiled+passes", "fsdp2-zero3 compiled", ...
    prepare: Callable[[], None]  # sets inductor's pass config before the first (compiling) step
    step_fn: Callable[[int], torch.Tensor]
    compiled: bool
    first: float = 0.0
    times: list[float] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    n: int = 0

    def step(self) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        self.losses.append(self.step_fn(self.n))
        self.n += 1
        return time.perf_counter() - t0


def _train_step(cfg: Config, call, clip, opt, rank: int, before_micro=None):
    def step(i: int) -> torch.Tensor:
        total = torch.zeros(())
        for a in range(cfg.accum):
            if before_micro is not None:
                before_micro(a)
            loss = call(batch_for(cfg, rank, i, a)).loss / cfg.accum
            loss.backward()
            total += loss.detach()
        clip()
        opt.step()
        opt.zero_grad()
        return total
    return step


def paro_variant(cfg: Config, strategy: str, mode: str) -> Variant:
    rank = dist.get_rank()
    model = paro_shard(make_model(cfg.args), init_paro_mesh(GROUP), strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    if mode != "eager":  # the whole boundary in graphs: the last backward's reduction, the push to P;
        # the passes bound to this model's compiles only
        passes.compile_model(model, passes.ORDER if mode == "compiled+passes" else (), scope="model")
    before = lambda a: model.set_requires_gradient_sync(a == cfg.accum - 1)  # noqa: E731
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # noqa: E731
    return Variant(f"PaRO {strategy} {mode}", lambda: None, _train_step(cfg, model, clip, opt, rank, before),
                   mode != "eager")


def fsdp2_variant(cfg: Config, kind: str, mode: str) -> Variant:
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    if kind == "fsdp2-zero3":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    else:
        mesh = init_device_mesh("cpu", (WORLD // GROUP, GROUP), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = make_model(cfg.args)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    call = model if mode == "eager" else torch.compile(model)
    hsdp = mesh.ndim == 2
    before = (lambda a: model.set_requires_all_reduce(a == cfg.accum - 1)) if hsdp else None
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # noqa: E731
    return Variant(f"{kind} {mode}", passes.uninstall, _train_step(cfg, call, clip, opt, rank, before), mode != "eager")


def build(cfg: Config) -> list[Variant]:
    out = []
    for s in cfg.strategies:
        out += [paro_variant(cfg, s, m) for m in ("eager", "compiled", "compiled+passes")]
    for s in cfg.strategies:
        if s in FSDP2_EQUIVALENT:
            out += [fsdp2_variant(cfg, FSDP2_EQUIVALENT[s], m) for m in ("eager", "compiled")]
    return out


def report(cfg: Config, variants: list[Variant], warm: tuple[str, float] | None) -> None:
    med = {v.name: statistics.median(reduce_max(v.times)) * 1e3 for v in variants}
    first = {v.name: max(reduce_max([v.first])) for v in variants}
    loss = {v.name: reduce_mean(v.losses)[cfg.rounds] for v in variants}  # same step for all (not the warm rerun)
    if dist.get_rank() != 0:
        return
    a = cfg.args
    print(f"\nmodel dim {a.dim} x {a.n_layers} layers, vocab {a.vocab_size}; micro-batch {cfg.batch} x {cfg.seq}; "
          f"A = {cfg.accum}; {WORLD} gloo ranks as {WORLD // GROUP} groups x {GROUP}; {cfg.rounds} rounds")
    print(f"{'variant':<28}{'step ms':>9}{'vs eager':>10}{'vs FSDP2+c':>12}{'1st step s':>12}{'last loss':>12}")
    for v in variants:
        strat = v.name.split()[1] if v.name.startswith("PaRO") else None
        eager = f"PaRO {strat} eager" if strat else v.name.rsplit(" ", 1)[0] + " eager"
        fsdp = f"{FSDP2_EQUIVALENT[strat]} compiled" if strat in FSDP2_EQUIVALENT else None
        vs_fsdp = f"{med[v.name] / med[fsdp]:.2f}" if fsdp in med and v.compiled and strat else "-"
        print(f"{v.name:<28}{med[v.name]:>9.1f}{med[v.name] / med[eager]:>10.2f}{vs_fsdp:>12}"
              f"{first[v.name]:>12.1f}{loss[v.name]:>12.5f}")
    print("step ms: median over rounds of the slowest rank; ratios < 1 mean faster. 1st step s: the step that "
          "compiles (cold: empty inductor cache, 4 ranks compiling on the shared cores).")
    if warm:
        print(f"warm compile ({warm[0]}, after torch._dynamo.reset(), FX-graph cache hits): first step {warm[1]:.1f} s")


def _rank_main(cfg: Config) -> None:
    """One rank of ``tools.local_world``'s world."""
    torch.set_num_threads(1)
    isolate_compile_cache(dist.get_rank())
    # every variant compiles the same forward code, and each PaRO one twice (the last micro-step's
    # graph differs): past dynamo's default of 8 compilations per code object it would silently
    # run the rest eagerly, so raise the limit and fail loudly rather than measure eager as compiled
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    variants = build(cfg)
    for v in variants:  # the compiling step, one variant at a time (passes are a global setting)
        v.prepare()
        v.first = v.step()
    passes.uninstall()
    for r in range(cfg.rounds):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            v.times.append(v.step())
    warm = None
    target = next((v for v in variants if v.name.endswith("compiled+passes")), None)
    if target is not None:
        torch._dynamo.reset()
        target.prepare()
        warm = (target.name, max(reduce_max([target.step()])))
        passes.uninstall()
    report(cfg, variants, warm)


def parse_args() -> Config:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--strategies", nargs="+", default=["GGG", "III"])
    ns = ap.parse_args()
    return Config(model_args_from(ns), ns.batch, ns.seq, ns.accum, ns.rounds, tuple(ns.strategies))


def main() -> None:
    cfg = parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="paro-inductor-") as cache:
        run_local_world(WORLD, "tools.bench.compiled:_rank_main", cfg, timeout=24 * 3600,
                        env={"TORCHINDUCTOR_CACHE_DIR": cache})
    print(f"total wall time including process start: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
