"""Which PaRO strategy to run: every strategy's predicted step time and memory, ranked.

    python -m tools.advisor --model llama7b --gpus 64 --gpus-per-node 8 --cluster a100_ib.toml \\
        --micro-batch 2 --grad-accum 4 [--trainable 0.0625] [--plot out.png | --no-plot]
    python -m tools.advisor ... --sweep gpus [--values 16,32,64,128]
    python -m tools.advisor ... --sweep inter-gbps [--values 50,100,200,400,800,1600,3200]
    python -m tools.advisor --params 30e9 --layers 60 --hidden 6656 --gpus 128 ...

Why: PaRO's best strategy depends on the model, the cluster and the batch (PARO_SPEC.md section
5); this answers it before any GPU is rented. The cost model is ``paro_fsdp.cost`` (the
formulas: ``cost/predict.py``'s docstring): exact bytes and model-state memory from the spec's ledger, plus
activations, compute at the cluster's achieved FLOP/s and the communication that cannot hide
behind compute. The cluster file is a preset of paro_fsdp/cost/clusters/ (a100_ib, h800_roce, h100_ndr)
or what ``python -m tools.calibrate`` measured.

Output: the ranked table (fitting strategies by predicted step time, then the OOM ones):
predicted step time, tokens/s, speed-up over GGG (ZeRO-3), memory per GPU, fits/OOM, whether
activation checkpointing is needed (``--activation-checkpoint auto``: only when it does not fit
without), intra and inter GB sent per GPU per step; and a PNG: memory per GPU vs predicted step
time, one labelled point per strategy, the Pareto front, the OOM region shaded. ``--sweep``
plots predicted throughput per strategy over GPU counts or inter-node bandwidth instead.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

from paro_fsdp.models.llama import FLAVORS, LlamaArgs
from paro_fsdp.strategy import ALL_STRATEGIES, Strategy
from paro_fsdp.cost.cluster import AdvisorError, Cluster, GiB, load_cluster
from paro_fsdp.cost.model import ModelSpec, model_spec
from paro_fsdp.dtypes import DTYPES
from paro_fsdp.cost.predict import (
    ACTIVATION_CHECKPOINT_MODES,
    NAMED_STRATEGIES,
    Prediction,
    format_table,
    rank_strategies,
)

DEFAULT_SWEEP = {"gpus": "16,32,64,128", "inter-gbps": "50,100,200,400,800,1600,3200,6400"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AdvisorError("plots need matplotlib: pip install matplotlib (or pass --no-plot)") from None
    return plt


def pareto_front(preds: Sequence[Prediction]) -> list[Prediction]:
    """Strategies no other one beats on both memory and step time, by increasing memory."""
    front: list[Prediction] = []
    for p in sorted(preds, key=lambda p: (p.memory["total"], p.step_time)):
        if not front or p.step_time < front[-1].step_time:
            front.append(p)
    return front


def plot_memory_vs_time(preds: Sequence[Prediction], cluster: Cluster, title: str, path: Path) -> Path:
    """Memory per GPU (x) vs predicted step time (y): labelled points, Pareto front, OOM shaded."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 6.5))
    xs = [p.memory["total"] / GiB for p in preds]
    limit = cluster.usable_bytes / GiB
    log_x = max(xs) / max(min(xs), 1e-9) > 8
    named = set(NAMED_STRATEGIES)
    for p, x in zip(preds, xs):
        color = "tab:blue" if p.fits else "tab:red"
        ax.scatter(x, p.step_time, s=40 if p.strategy in named else 18, color=color,
                   marker="o" if p.strategy in named else ".", zorder=3)
        ax.annotate(p.strategy + ("*" if p.activation_checkpoint else ""), (x, p.step_time), fontsize=7,
                    xytext=(3, 3), textcoords="offset points", fontweight="bold" if p.strategy in named else "normal")
    front = pareto_front(preds)
    ax.step([p.memory["total"] / GiB for p in front], [p.step_time for p in front], where="post",
            color="tab:green", lw=1.5, label="Pareto front (memory vs time)", zorder=2)
    right = max(max(xs) * (1.5 if log_x else 1.05), limit * 1.1)
    ax.axvspan(limit, right, color="tab:red", alpha=0.08, label=f"OOM (> {limit:.0f} GiB usable)")
    ax.axvline(limit, color="tab:red", lw=0.8)
    best = next((p for p in preds if p.fits), None)
    if best is not None:
        ax.scatter(best.memory["total"] / GiB, best.step_time, s=160, facecolors="none", edgecolors="black",
                   zorder=4, label=f"chosen: {best.strategy}")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlim(right=right)
    ax.set_xlabel("memory per GPU (GiB): model states + working set + activations")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(_wrap(title), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.text(0.01, 0.01, "* = activation checkpointing; bold = known strategies", transform=ax.transAxes, fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _efficiency(c: Cluster) -> float:
    """Fraction of the node's line rate the inter link achieves (for Gb/s conversions)."""
    if c.inter_efficiency is not None:
        return c.inter_efficiency
    if c.node_gbps:
        return c.inter.bandwidth_gbs * c.gpus_per_node * 8 / c.node_gbps
    return 0.9


def with_node_gbps(c: Cluster, gbps: float) -> Cluster:
    """The same cluster with ``gbps`` Gbit/s of network per node (same efficiency)."""
    if gbps <= 0:
        raise AdvisorError(f"inter-node bandwidth must be > 0 Gb/s, got {gbps}")
    eff = _efficiency(c)
    inter = replace(c.inter, bandwidth_gbs=gbps / 8 * eff / c.gpus_per_node, per_kind={})
    return replace(c, inter=inter, node_gbps=gbps, inter_efficiency=eff, name=f"{c.name}@{gbps:g}Gbps")


def node_gbps_equivalent(c: Cluster, per_gpu_gbs: float) -> float:
    """Gbit/s per node that gives ``per_gpu_gbs`` GB/s per GPU on the inter link."""
    return per_gpu_gbs * c.gpus_per_node * 8 / _efficiency(c)


def custom_model(params: float, layers: int, hidden: int, vocab_size: int = 32000, heads: Optional[int] = None,
                 trainable_fraction: float = 1.0) -> ModelSpec:
    """A Llama-shaped model from Psi, depth and width (LLaMA-style: head dim 128, SwiGLU FFN
    sized so the total is ``params``)."""
    if layers < 1 or hidden < 1 or params <= 0:
        raise AdvisorError(f"--params, --layers, --hidden must be positive, got {params}, {layers}, {hidden}")
    heads = heads or max(1, hidden // 128)
    root = 2 * vocab_size * hidden + hidden
    per_layer = (params - root) / layers
    ffn = round((per_layer - 4 * hidden * hidden - 2 * hidden) / (3 * hidden))
    if ffn < 1:
        raise AdvisorError(f"{params:.3g} parameters are too few for {layers} layers of width {hidden} "
                           f"(attention and embeddings alone need {root + layers * 4 * hidden * hidden:.3g})")
    args = LlamaArgs(dim=hidden, n_layers=layers, n_heads=heads, ffn_dim=ffn, vocab_size=vocab_size)
    return replace(model_spec(args, trainable_fraction), name=f"{params / 1e9:.3g}B")


def sweep(spec: ModelSpec, what: str, values: Sequence[float], cluster: Cluster, m: int, kw: dict[str, Any],
          strategies: Sequence[str]) -> list[dict[str, Any]]:
    """Predictions over GPU counts or node inter bandwidths: one row per value."""
    rows = []
    for v in values:
        c, n = cluster, kw["n"]
        if what == "gpus":
            n = int(v)
        else:
            c = with_node_gbps(cluster, float(v))
        preds = rank_strategies(spec, n, m, kw["micro_batch"], kw["grad_accum"], kw["seq_len"], c,
                                dtype=kw["dtype"], reduce_dtype=kw["reduce_dtype"],
                                activation_checkpoint=kw["activation_checkpoint"],
                                reshard_after_forward=kw["reshard_after_forward"], strategies=strategies,
                                inter_dtype=kw["inter_dtype"])
        by = {p.strategy: p for p in preds}
        best = next((p for p in preds if p.fits), None)
        ggg = by.get("GGG")
        rows.append({"value": v, "n": n, "inter_gbs_per_gpu": c.inter.bandwidth_gbs, "preds": by,
                     "best": best.strategy if best else None,
                     "best_vs_ggg": (ggg.step_time / best.step_time) if best and ggg and ggg.fits else None})
    return rows


def format_sweep(rows: list[dict[str, Any]], what: str, shown: Sequence[str]) -> str:
    head = f"{'GPUs' if what == 'gpus' else 'Gb/s/node':>9} {'GB/s/GPU':>8} | " + " ".join(f"{s:>8}" for s in shown) + \
        f" | {'best':>5} {'vs GGG':>7}"
    lines = ["predicted throughput, thousand tokens/s (OOM: does not fit)", head, "-" * len(head)]
    for r in rows:
        cells = []
        for s in shown:
            p = r["preds"].get(s)
            cells.append(f"{'OOM' if p is None or not p.fits else f'{p.tokens_per_s / 1e3:.1f}':>8}")
        vs = f"{r['best_vs_ggg']:6.2f}x" if r["best_vs_ggg"] else "    -  "
        lines.append(
            f"{r['value']:>9g} {r['inter_gbs_per_gpu']:8.3g} | " + " ".join(cells) + f" | {r['best'] or '-':>5} {vs}"
        )
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], what: str, shown: Sequence[str], cluster: Cluster, title: str,
               path: Path) -> Path:
    """Throughput per strategy (lines, OOM points left out) and the best's speed-up over GGG."""
    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    xs = [r["value"] for r in rows]
    for s in shown:
        ys = [r["preds"][s].tokens_per_s if s in r["preds"] and r["preds"][s].fits else math.nan for r in rows]
        if all(math.isnan(y) for y in ys):
            continue  # never fits: nothing to draw (the table says OOM)
        style = "-" if s in ("GGG", "IIG", "NIG", "IGG", "ING") else "--"
        ax.plot(xs, ys, style, marker="o", ms=3, label=s + ("" if Strategy.parse(s).known_as == "PaRO" else
                                                             f" ({Strategy.parse(s).known_as.split(' /')[0]})"))
    ax2.plot(xs, [r["best_vs_ggg"] or math.nan for r in rows], "k-o", ms=3)
    ax2.axhline(1.0, color="gray", lw=0.8)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        if what != "gpus":
            a.set_xscale("log")
    if what != "gpus":
        eq = node_gbps_equivalent(cluster, cluster.intra.bandwidth_gbs)
        for a in (ax, ax2):
            a.axvline(eq, color="tab:purple", lw=0.8, ls=":")
        ax.text(
            eq, ax.get_ylim()[0], " inter = intra per GPU", color="tab:purple", fontsize=7, rotation=90, va="bottom"
        )
    ax.set_ylabel("predicted tokens/s (all GPUs)")
    ax2.set_ylabel("best / GGG")
    ax2.set_xlabel("GPUs" if what == "gpus" else "inter-node bandwidth per node (Gb/s)")
    ax.set_title(_wrap(title), fontsize=8)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wrap(title: str) -> str:
    return "\n".join(textwrap.fill(line, 150) for line in title.split("\n"))


def _parse_values(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AdvisorError(f"--values {text!r}: a comma-separated list of numbers") from None
    if not values or any(v <= 0 for v in values):
        raise AdvisorError(f"--values {text!r}: positive numbers, e.g. {DEFAULT_SWEEP[what]}")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.advisor", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("model")
    g.add_argument("--model", default=None, help=f"flavor: {', '.join(sorted(FLAVORS))} (default llama7b)")
    g.add_argument("--params", type=float, default=None, help="or a Llama-shaped model: total parameters (e.g. 30e9)")
    g.add_argument("--layers", type=int, default=None, help="with --params: transformer layers")
    g.add_argument("--hidden", type=int, default=None, help="with --params: hidden size")
    g.add_argument("--vocab", type=int, default=32000, help="with --params: vocabulary size")
    g.add_argument("--trainable", type=float, default=1.0, help="trainable fraction Psi'/Psi (whole leading layers)")
    g = ap.add_argument_group("run")
    g.add_argument("--gpus", type=int, default=64, help="number of GPUs n")
    g.add_argument("--gpus-per-node", type=int, default=None, help="default: the cluster file's")
    g.add_argument("--group-size", type=int, default=None, help="PaRO group size m (default: GPUs per node)")
    g.add_argument("--micro-batch", type=int, default=2, help="sequences per GPU per micro-step")
    g.add_argument("--grad-accum", type=int, default=4, help="micro-steps A per optimizer step")
    g.add_argument("--seq-len", type=int, default=2048)
    g.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="parameter dtype")
    g.add_argument("--reduce-dtype", default=None, choices=sorted(DTYPES), help="gradient dtype (default --dtype)")
    g.add_argument("--inter-dtype", default=None, choices=("int8", "int4"),
                   help="what crosses groups, quantized (MixedPrecision.inter_dtype; default: exact)")
    g.add_argument("--activation-checkpoint", default="auto", choices=ACTIVATION_CHECKPOINT_MODES,
                   help="auto: per strategy, only when it does not fit without")
    g.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="blocks stay gathered from forward to backward (what the trainer needs with activation "
        "checkpointing today)",
    )
    g.add_argument("--strategies", default=None, help="comma-separated subset (default: all 27)")
    g = ap.add_argument_group("cluster")
    g.add_argument("--cluster", default="a100_ib.toml", help="a TOML file or a preset of paro_fsdp/cost/clusters/")
    g.add_argument("--inter-gbps", type=float, default=None, help="override the inter-node bandwidth per node (Gb/s)")
    g = ap.add_argument_group("output")
    g.add_argument("--plot", default=None, help="PNG path (default <out-dir>/advisor_<model>_<gpus>gpus[_sweep].png)")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument(
        "--out-dir",
        default="outputs/advisor",
        help="folder for the plot when --plot names no path (default: outputs/advisor)",
    )
    g.add_argument(
        "--sweep", choices=sorted(DEFAULT_SWEEP), default=None, help="throughput over GPU counts or inter bandwidth"
    )
    g.add_argument("--values", default=None, help="sweep values, comma-separated")
    g.add_argument("--json", action="store_true", help="print the ranked predictions as JSON")
    return ap


def _spec_from_args(a: argparse.Namespace) -> ModelSpec:
    if a.params is not None:
        if a.model is not None:
            raise AdvisorError("give either --model or --params/--layers/--hidden, not both")
        if a.layers is None or a.hidden is None:
            raise AdvisorError("--params needs --layers and --hidden")
        return custom_model(a.params, a.layers, a.hidden, a.vocab, trainable_fraction=a.trainable)
    return model_spec(a.model or "llama7b", a.trainable)


def _cluster_from_args(a: argparse.Namespace) -> Cluster:
    c = load_cluster(a.cluster)
    if a.gpus_per_node is not None and a.gpus_per_node != c.gpus_per_node:
        if a.gpus_per_node < 1:
            raise AdvisorError(f"--gpus-per-node must be positive, got {a.gpus_per_node}")
        # the node's network is now shared by a different number of GPUs
        inter = replace(c.inter, bandwidth_gbs=c.inter.bandwidth_gbs * c.gpus_per_node / a.gpus_per_node, per_kind={})
        c = replace(c, gpus_per_node=a.gpus_per_node, inter=inter)
    if a.inter_gbps is not None:
        c = with_node_gbps(c, a.inter_gbps)
    return c


def _as_json(p: Prediction) -> dict[str, Any]:
    return {"strategy": p.strategy, "known_as": p.known_as, "step_time_s": p.step_time, "tokens_per_s": p.tokens_per_s,
            "fits": p.fits, "activation_checkpoint": p.activation_checkpoint, "memory_bytes": p.memory,
            "intra_bytes": p.intra_bytes, "inter_bytes": p.inter_bytes, "global_bytes": p.global_bytes,
            "collectives": p.traffic.as_dict(), "breakdown_s": p.breakdown}


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return _run(a)
    except AdvisorError as exc:
        print(f"advisor: error: {exc}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    spec = _spec_from_args(a)
    cluster = _cluster_from_args(a)
    m = a.group_size or (cluster.gpus_per_node if a.gpus >= cluster.gpus_per_node else a.gpus)
    strategies = [Strategy.parse(s).name for s in a.strategies.split(",")] if a.strategies else list(ALL_STRATEGIES)
    kw = dict(n=a.gpus, micro_batch=a.micro_batch, grad_accum=a.grad_accum, seq_len=a.seq_len, dtype=a.dtype,
              reduce_dtype=a.reduce_dtype, activation_checkpoint=a.activation_checkpoint,
              reshard_after_forward=not a.no_reshard_after_forward, inter_dtype=a.inter_dtype)
    desc = (
        f"{spec.name}: {spec.psi / 1e9:.2f}B params, {spec.psi_trainable / spec.psi:.1%} trainable "
        f"({spec.trainable_layers}/{spec.n_layers} layers{', root too' if spec.root_trainable else ''}); "
        f"{a.micro_batch} x {a.seq_len} tokens per micro-step, A = {a.grad_accum}, "
        f"{a.dtype}/{a.reduce_dtype or a.dtype}{f', {a.inter_dtype} between groups' if a.inter_dtype else ''}; "
        f"cluster {cluster.name}: {cluster.gpus_per_node} GPUs/node, {cluster.memory_gib:g} GiB, "
        f"{cluster.achieved_tflops:g} TFLOP/s achieved, intra {cluster.intra.bandwidth_gbs:g} GB/s/GPU, "
        f"inter {cluster.inter.bandwidth_gbs:.3g} GB/s/GPU"
        + (f" ({cluster.node_gbps:g} Gb/s/node)" if cluster.node_gbps else "")
    )
    if a.sweep:
        values = _parse_values(a.values or DEFAULT_SWEEP[a.sweep], a.sweep)
        if a.sweep == "inter-gbps" and a.values is None:  # up to where inter equals intra per GPU
            values.append(round(node_gbps_equivalent(cluster, cluster.intra.bandwidth_gbs)))
        if a.sweep == "gpus":
            bad = [int(v) for v in values if int(v) != v or int(v) % m]
            if bad:
                raise AdvisorError(f"--values {bad}: GPU counts must be integers divisible by the group size {m}")
        shown = [s for s in (a.strategies.split(",") if a.strategies else NAMED_STRATEGIES)]
        shown = [Strategy.parse(s).name for s in shown]
        rows = sweep(spec, a.sweep, values, cluster, m, kw, strategies)
        extra = sorted({r["best"] for r in rows if r["best"] and r["best"] not in shown})
        print(desc)
        print(format_sweep(rows, a.sweep, shown + extra))
        if not a.no_plot:
            path = Path(a.plot) if a.plot else Path(a.out_dir) / f"advisor_{spec.name}_{a.gpus}gpus_sweep_{a.sweep}.png"
            title = f"{desc}\n" + ("n = GPUs" if a.sweep == "gpus" else f"n = {a.gpus}") + f", m = {m}"
            print(f"plot: {plot_sweep(rows, a.sweep, shown + extra, cluster, title, path)}")
        return 0
    preds = rank_strategies(spec, a.gpus, m, a.micro_batch, a.grad_accum, a.seq_len, cluster,
                            dtype=a.dtype, reduce_dtype=a.reduce_dtype, activation_checkpoint=a.activation_checkpoint,
                            reshard_after_forward=not a.no_reshard_after_forward, strategies=strategies,
                            inter_dtype=a.inter_dtype)
    if a.json:
        print(json.dumps([_as_json(p) for p in preds], indent=1))
        return 0
    header = f"{desc}\n{a.gpus} GPUs = {a.gpus // m} groups x {m}"
    print(format_table(preds, cluster, header))
    best = next((p for p in preds if p.fits), None)
    if best is None:
        small = min(preds, key=lambda p: p.memory["total"])
        print(f"nothing fits: the smallest, {small.strategy}, needs {small.memory['total'] / GiB:.1f} GiB "
              f"> {cluster.usable_bytes / GiB:.1f} GiB usable")
    else:
        ggg = next((p for p in preds if p.strategy == "GGG"), None)
        vs = f", {ggg.step_time / best.step_time:.2f}x ZeRO-3 (GGG)" if ggg and ggg.fits else ""
        print(
            f"recommended: {best.strategy} "
            f"({best.known_as}){' with activation checkpointing' if best.activation_checkpoint else ''}: "
            f"{best.step_time:.3f} s/step, {best.tokens_per_s:,.0f} tokens/s{vs}, {best.memory['total'] / GiB:.1f} "
            "GiB per GPU"
        )
        close = [p for p in preds if p.fits and p is not best and p.step_time <= 1.01 * best.step_time]
        if close:  # a near-tie is a choice the model cannot make: show the cheapest in memory too
            lean = min(close + [best], key=lambda p: p.memory["total"])
            print(f"within 1% of it: {', '.join(p.strategy for p in close)}; the least memory among them: "
                  f"{lean.strategy} ({lean.memory['total'] / GiB:.1f} GiB, {lean.step_time:.3f} s/step)")
    if not a.no_plot:
        path = Path(a.plot) if a.plot else Path(a.out_dir) / f"advisor_{spec.name}_{a.gpus}gpus.png"
        print(f"plot: {plot_memory_vs_time(preds, cluster, header, path)}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
