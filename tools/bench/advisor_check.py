"""Predicted vs measured step time on local CPU ranks, after calibrating them.

    python -m tools.bench.advisor_check [--nproc 4 --group-size 2] [--strategies NNN,NNG,GGG,III,NIG,IIG,IGG,ING]
        [--steps 3] [--out cpu_check.toml]

Why: the advisor is a model; this is where it meets a measurement. One spawn of ``nproc`` gloo
ranks (a (nproc/m, m) mesh) first runs ``calibrate_in_process`` (collective bandwidth and
latency per kind and mesh dimension, a transformer block's FLOP/s at the check model's shape,
memory bandwidth, compute/communication overlap), then trains the check model (fp32, small
enough for shared CPU cores) with every strategy at once, round-robin: a warm-up round, then
``--steps`` rounds of one optimizer step per strategy; a step's time is its slowest rank's, and
a strategy's is the fastest of its steps (the least disturbed by other work on the machine;
the median is printed too). The parent predicts each strategy's step time from
the calibrated cluster and prints predicted, measured and their ratio, and checks on the way
that the advisor's per-step bytes equal the engine's ``comm_stats`` for every strategy.

Not modelled, so expect measured > predicted on CPU: the engine's per-block Python work (hooks,
flattening, copies), gloo's reduce-scatter being an all-reduce (partly caught by calibrating
each kind), and ranks competing for the same cores (caught only as far as the calibration ran
under the same contention).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Optional, Sequence

from paro_fsdp.cost.cluster import Cluster, cluster_to_toml
from paro_fsdp.cost.predict import predict
from tools.local_world import run_local_world
from paro_fsdp.models.llama import LlamaArgs

CHECK = LlamaArgs(dim=256, n_layers=4, n_heads=4, ffn_dim=704, vocab_size=4096, max_seq_len=128)
MICRO_BATCH, SEQ_LEN, GRAD_ACCUM = 2, 64, 2
DEFAULT_STRATEGIES = "NNN,NNG,NGG,GGG,III,NIG,IIG,IGG,ING"


def _rank_main(payload: dict[str, Any]) -> dict[str, Any]:
    """On every rank: calibrate, then time each strategy. Rank 0's dict goes back."""
    import torch
    import torch.distributed as dist

    from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
    from paro_fsdp.cost.calibrate import calibrate_in_process
    from paro_fsdp.models.llama import Llama

    mesh = init_paro_mesh(payload["group_size"])
    rank = dist.get_rank()
    t0 = time.perf_counter()
    cluster = calibrate_in_process(mesh, replace(CHECK, n_layers=1), MICRO_BATCH, SEQ_LEN, "fp32",
                                   sizes_mib=payload["sizes_mib"], reps=payload["reps"], name="cpu_check")
    calib_s = time.perf_counter() - t0
    out: dict[str, Any] = {"cluster": cluster, "calibration_s": calib_s, "results": {}}
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, CHECK.vocab_size, (MICRO_BATCH, SEQ_LEN + 1), generator=gen) for _ in range(GRAD_ACCUM)]
    runs = {}
    for name in payload["strategies"]:
        torch.manual_seed(0)
        model = paro_shard(Llama(CHECK), mesh, name, mp=MixedPrecision(torch.float32))
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True))
    times: dict[str, list[float]] = {name: [] for name in runs}
    # round-robin (one step of each strategy per round), so a busy spell of the shared machine
    # hits every strategy alike; the first round is a warm-up
    for step in range(1 + payload["steps"]):
        for name, (model, opt) in runs.items():
            model.comm_stats().reset()
            dist.barrier()
            start = time.perf_counter()
            for a, b in enumerate(batches):
                model.set_requires_gradient_sync(a == GRAD_ACCUM - 1)  # the boundary under the last backward
                (model(b).loss / GRAD_ACCUM).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            dt = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
            if step:
                times[name].append(float(dt))
    for name, (model, opt) in runs.items():
        out["results"][name] = {"measured_s": min(times[name]), "median_s": statistics.median(times[name]),
                                "steps": times[name], "collectives": model.comm_stats().as_dict(),
                                "memory": model.memory_report(opt)}
    return out


def compare(out: dict[str, Any], n: int, m: int) -> tuple[str, list[dict[str, Any]]]:
    """The predicted-vs-measured table, and one row per strategy."""
    cluster: Cluster = out["cluster"]
    rows = []
    for name, r in out["results"].items():
        p = predict(CHECK, name, n, m, MICRO_BATCH, GRAD_ACCUM, SEQ_LEN, cluster, dtype="fp32")
        expected = p.traffic.as_dict()
        got = r["collectives"]
        bytes_ok = set(expected) == set(got) and all(
            abs(got[k]["bytes"] - e["bytes"]) <= 1e-9 * max(1.0, e["bytes"]) and got[k]["count"] == e["count"]
            for k, e in expected.items())
        mem_ok = all(abs(r["memory"][k] - p.memory[k]) < 1e-6 for k in ("P", "G", "OS"))
        rows.append(
            {
                "strategy": name,
                "predicted_s": p.step_time,
                "measured_s": r["measured_s"],
                "median_s": r["median_s"],
                "ratio": r["measured_s"] / p.step_time,
                "compute_s": p.compute,
                "exposed_s": p.exposed_comm,
                "comm_total_s": p.comm_total,
                "optimizer_s": p.optimizer,
                "bytes_match": bytes_ok,
                "memory_match": mem_ok,
            }
        )
    head = (
        f"{'strat':5} {'predicted s':>11} {'measured s':>10} {'meas/pred':>9} {'median s':>9} | {'compute':>8} "
        f"{'exposed':>8} "
        f"{'all comm':>8} {'optim':>7} | bytes  state-mem"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['strategy']:5} {r['predicted_s']:11.4f} {r['measured_s']:10.4f} {r['ratio']:9.2f} "
            f"{r['median_s']:9.4f} | "
            f"{r['compute_s']:8.4f} {r['exposed_s']:8.4f} {r['comm_total_s']:8.4f} {r['optimizer_s']:7.4f} | "
            f"{'equal' if r['bytes_match'] else 'DIFFER':6} {'equal' if r['memory_match'] else 'DIFFER'}"
        )
    ratios = [r["ratio"] for r in rows]
    pred_order = [r["strategy"] for r in sorted(rows, key=lambda r: r["predicted_s"])]
    meas_order = [r["strategy"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    lines.append(f"meas/pred: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
                 f"order predicted {' < '.join(pred_order)}; measured {' < '.join(meas_order)}")
    return "\n".join(lines), rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.advisor_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES)
    ap.add_argument(
        "--steps",
        type=int,
        default=5,
        help="timed rounds (one optimizer step per strategy each), after a warm-up round",
    )
    ap.add_argument("--reps", type=int, default=3, help="calibration repetitions per size")
    ap.add_argument("--sizes-mib", default="0.0625,0.5,2,8")
    ap.add_argument("--out", default=None, help="also write the calibrated cluster TOML here")
    a = ap.parse_args(argv)
    if a.nproc % a.group_size:
        print(f"advisor_check: error: group size {a.group_size} does not divide --nproc {a.nproc}", file=sys.stderr)
        return 2
    payload = {"group_size": a.group_size, "strategies": a.strategies.split(","), "steps": a.steps, "reps": a.reps,
               "sizes_mib": [float(x) for x in a.sizes_mib.split(",")]}
    wall = time.perf_counter()
    out = run_local_world(a.nproc, "tools.bench.advisor_check:_rank_main", payload)[0]
    c = out["cluster"]
    print(
        f"check model: dim {CHECK.dim}, {CHECK.n_layers} layers, ffn {CHECK.ffn_dim}, vocab {CHECK.vocab_size}, fp32; "
        f"micro-batch {MICRO_BATCH} x {SEQ_LEN} tokens, A = {GRAD_ACCUM}; {a.nproc} gloo ranks = "
        f"{a.nproc // a.group_size} groups x {a.group_size}"
    )
    print(
        f"calibrated in {out['calibration_s']:.1f} s: achieved {c.achieved_tflops * 1e3:.1f} GFLOP/s per rank, "
        f"memory {c.memory_bandwidth_gbs:.2f} GB/s, overlap {c.overlap:.2f}; intra AG {c.intra.bandwidth_gbs:.3f} GB/s "
        f"{c.intra.latency_us:.0f} us/step, inter AG {c.inter.bandwidth_gbs:.3f} GB/s {c.inter.latency_us:.0f} us/step"
    )
    table, _ = compare(out, a.nproc, a.group_size)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(cluster_to_toml(c, ["calibrated by python -m tools.bench.advisor_check"]))
        print(f"wrote {a.out}")
    print(f"({time.perf_counter() - wall:.0f} s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
