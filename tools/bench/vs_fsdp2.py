"""Step time of the PaRO engine against FSDP2 on the equivalent strategy (4 CPU gloo ranks).

Run (one command, also ``make bench``; it starts the 4 gloo ranks itself, tools.local_world)::

    .venv/bin/python -m tools.bench.vs_fsdp2              # the table: ~80 s on 2 shared cores
    .venv/bin/python -m tools.bench.vs_fsdp2 --profile    # + where PaRO's time goes: ~2 min

The default model (dim 128, 4 layers, vocab 1024, micro-batch 2 x 128 tokens, 1.0M params) takes
~0.2-0.3 s per A=1 step with 4 single-threaded ranks on 2 cores; ``--dim 256 --heads 8 --kv-heads 4
--ffn 704 --vocab 2048`` (4M params) is ~0.6-0.9 s per step and ~2 min with ``--rounds 5``.

``torchrun --nproc-per-node 4 -m tools.bench.vs_fsdp2`` works too (the script sees RANK in the
environment and runs as one rank instead of spawning).

Why: PaRO's GGG is ZeRO-3 and III is HSDP/MiCS, so on those two strategies FSDP2 is the yardstick:
same model, same data, same AdamW, same collectives. The target is PaRO within 1.10x of FSDP2.

Pairs compared (mesh 2 groups x 2 ranks):
  GGG  paro_shard(model, init_paro_mesh(2), "GGG")   vs  fully_shard on the 1D world mesh (ZeRO-3)
  III  paro_shard(model, init_paro_mesh(2), "III")   vs  fully_shard on a 2D (2, 2) mesh (HSDP)
both wrapped per transformer block plus the root, reshard_after_forward=True, fp32, eager.

One step = A micro-steps of forward+backward (loss / A), clip_grad_norm_(1.0), optimizer step,
zero_grad; both engines with torch's AdamW over ``model.parameters()`` and torch's
``clip_grad_norm_``. For HSDP with A > 1, FSDP2 gets its documented accumulation idiom
(``set_requires_all_reduce(False)`` except on the last micro-step), and PaRO its own
(``set_requires_gradient_sync(False)`` except on the last micro-step: gradients stay at the G
level, so III all-reduces across groups once per step); ZeRO-3 reduce-scatters every micro-step
in both engines.

Timing: every model (all pairs, both A) lives at once and the rounds interleave them, with the
PaRO/FSDP2 order flipped every round, so machine noise hits both sides alike. Each timed step
starts after a barrier; its time is the max over ranks; the table shows the median over rounds
after warmup. The loss columns (mean over ranks of the last step's loss) are a sanity check:
same init and data, so they should agree to ~1e-5.

``--profile`` then times the engine's own functions (by wrapping them at runtime: nothing in
paro_fsdp/ is modified) and prints a torch.profiler op table for PaRO and FSDP2 side by side.
"""
from __future__ import annotations

import argparse
import os
import sys
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paro_fsdp import init_paro_mesh, paro_shard
from paro_fsdp.models.llama import LlamaArgs
from tools.local_world import run_local_world

from .engine_profile import profile_runners
from .workload import (GROUP, LR, MAX_NORM, WD, WORLD, add_model_args, batch_for, make_model, model_args_from,
                       reduce_max, reduce_mean)


@dataclass(frozen=True)
class BenchConfig:
    args: LlamaArgs
    batch: int
    seq: int
    warmup: int
    rounds: int
    accums: tuple[int, ...]
    profile: bool


@dataclass
class Runner:
    """One sharded model with its optimizer; ``step`` runs one optimizer step on step ``i``'s data."""

    label: str  # "paro" or "fsdp2"
    model: torch.nn.Module
    step_fn: Callable[[int], torch.Tensor]
    n_steps: int = 0
    times: list[float] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)

    def step(self) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        loss = self.step_fn(self.n_steps)
        dt = time.perf_counter() - t0
        self.n_steps += 1
        self.losses.append(loss)
        return dt


def paro_runner(cfg: BenchConfig, strategy: str, accum: int) -> Runner:
    rank = dist.get_rank()
    model = paro_shard(make_model(cfg.args), init_paro_mesh(GROUP), strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def step(i: int) -> torch.Tensor:
        total = torch.zeros(())
        for a in range(accum):
            model.set_requires_gradient_sync(a == accum - 1)  # the boundary under the last backward
            loss = model(batch_for(cfg, rank, i, a)).loss / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        return total

    return Runner("paro", model, step)


def fsdp2_runner(cfg: BenchConfig, mesh: DeviceMesh, accum: int) -> Runner:
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    hsdp = mesh.ndim == 2
    model = make_model(cfg.args)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def step(i: int) -> torch.Tensor:
        total = torch.zeros(())
        for a in range(accum):
            if hsdp:
                model.set_requires_all_reduce(a == accum - 1)
            loss = model(batch_for(cfg, rank, i, a)).loss / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        return total

    return Runner("fsdp2", model, step)


@dataclass
class Pair:
    config: str  # "GGG vs ZeRO-3" / "III vs HSDP"
    accum: int
    paro: Runner
    fsdp: Runner


def build_pairs(cfg: BenchConfig) -> list[Pair]:
    mesh1d = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    mesh2d = init_device_mesh("cpu", (WORLD // GROUP, GROUP), mesh_dim_names=("dp_replicate", "dp_shard"))
    pairs = []
    for accum in cfg.accums:
        pairs.append(
            Pair("GGG vs FSDP2 ZeRO-3", accum, paro_runner(cfg, "GGG", accum), fsdp2_runner(cfg, mesh1d, accum))
        )
        pairs.append(Pair("III vs FSDP2 HSDP", accum, paro_runner(cfg, "III", accum), fsdp2_runner(cfg, mesh2d, accum)))
    return pairs


def run_rounds(pairs: list[Pair], warmup: int, rounds: int) -> None:
    """Interleave every runner; flip the PaRO/FSDP2 order each round (ABBA...)."""
    for r in range(warmup + rounds):
        for pair in pairs:
            order = (pair.paro, pair.fsdp) if r % 2 == 0 else (pair.fsdp, pair.paro)
            for runner in order:
                dt = runner.step()
                if r >= warmup:
                    runner.times.append(dt)


def report(pairs: list[Pair], cfg: BenchConfig, wall: float) -> None:
    rows = []
    for pair in pairs:
        tp = statistics.median(reduce_max(pair.paro.times)) * 1e3
        tf = statistics.median(reduce_max(pair.fsdp.times)) * 1e3
        lp, lf = reduce_mean(pair.paro.losses), reduce_mean(pair.fsdp.losses)
        dmax = max(abs(a - b) for a, b in zip(lp, lf))
        rows.append((pair.config, pair.accum, tp, tf, tp / tf, lp[-1], lf[-1], dmax))
    if dist.get_rank() != 0:
        return
    a = cfg.args
    n_params = sum(p.numel() for p in make_model(a).parameters())
    print(f"\nmodel: Llama dim={a.dim} layers={a.n_layers} heads={a.n_heads}/{a.n_kv_heads} ffn={a.ffn_dim} "
          f"vocab={a.vocab_size} ({n_params / 1e6:.2f}M params), micro-batch {cfg.batch}x{cfg.seq} per rank, "
          f"{WORLD} gloo ranks, mesh {WORLD // GROUP}x{GROUP}, fp32, 1 thread/rank")
    print(f"timing: median over {cfg.rounds} interleaved steps after {cfg.warmup} warmup, max over ranks\n")
    head = (f"{'config':<22} {'A':>2} {'PaRO ms':>9} {'FSDP2 ms':>9} {'ratio':>6}  "
            f"{'loss PaRO':>10} {'loss FSDP2':>10} {'max|dloss|':>10}")
    print(head)
    print("-" * len(head))
    for config, accum, tp, tf, ratio, lp, lf, dmax in rows:
        flag = "" if ratio <= 1.10 else "  > 1.10x"
        print(
            f"{config:<22} {accum:>2} {tp:>9.1f} {tf:>9.1f} {ratio:>6.3f}  {lp:>10.6f} {lf:>10.6f} {dmax:>10.2e}{flag}"
        )
    print(f"\nbench wall time (rank 0, after process-group init): {wall:.1f} s")


# ---- entry points ------------------------------------------------------------------------------
def worker(cfg: BenchConfig) -> None:
    """One rank under torchrun."""
    dist.init_process_group("gloo")
    _rank_main(cfg)
    dist.barrier()
    dist.destroy_process_group()


def _rank_main(cfg: BenchConfig) -> None:
    """One rank, in a process group already started (torchrun's, or ``tools.local_world``'s)."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    pairs = build_pairs(cfg)
    run_rounds(pairs, cfg.warmup, cfg.rounds)
    report(pairs, cfg, time.perf_counter() - t0)
    if cfg.profile:
        profile_runners(cfg, pairs, steps=2)


def parse_args() -> BenchConfig:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--profile", action="store_true", help="also time PaRO's engine functions and op profiles")
    ns = ap.parse_args()
    return BenchConfig(model_args_from(ns), ns.batch, ns.seq, ns.warmup, ns.rounds, tuple(ns.accum), ns.profile)


def main() -> None:
    cfg = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        if int(os.environ["WORLD_SIZE"]) != WORLD:
            raise SystemExit(f"this bench needs exactly {WORLD} ranks (2x2 mesh)")
        worker(cfg)
        return
    t0 = time.perf_counter()
    run_local_world(WORLD, "tools.bench.vs_fsdp2:_rank_main", cfg, timeout=24 * 3600)
    print(f"total wall time including process start: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
