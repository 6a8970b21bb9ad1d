"""The report of ``compiled_emulated.py`` (``python -m tools.bench --compiled``): the table, the
targets compiling must meet, the recompile reasons, and one timeline PNG per variant (the
profiler's rows of rank 0 over the node-0 uplink's throughput, sampled from the kernel's tx counter).

Pure functions of the rows the worker measured (no torch), so the formatting is tested alone.
"""
from __future__ import annotations

import os
import re
from typing import Sequence

MODES = ("eager", "compiled", "bucketing", "reorder", "all")
MODE_LABEL = {
    "eager": "eager",
    "compiled": "compiled",
    "bucketing": "compiled+bucketing",
    "reorder": "compiled+reorder",
    "all": "compiled+all passes",
}
BASELINE_LABEL = {"fsdp2-zero3": "FSDP2 ZeRO-3", "fsdp2-hsdp": "FSDP2 HSDP", "fsdp2-hpz": "FSDP2 raf=m"}
#: compiled + all passes against eager and against compiled without passes: (at least, at most)
TARGETS = {"GGG": (1.10, 1.25), "IGG": (1.10, 1.25), "IIG": (1.00, None), "NIG": (1.00, None), "NII": (1.00, None)}


LEGEND = [
    "tok/s: median of the interleaved rounds (slowest rank); vs eag / vs cmp: throughput over the same strategy's",
    "  (baseline's) eager / compiled-without-passes; first s: the step that compiles (slowest rank; kernels an",
    "  earlier variant built are reused); graphs / recomp: dynamo graphs captured / this variant's recompilations",
    "  (its own cache entry failed a guard), first step + later steps; inter MiB: sent per rank per step out of its",
    "  node (tx counters); util: node-0 uplink bytes per step over what the link carries in a step; busy: share of",
    "  the profiled step an inter or global collective runs on rank 0 (profiler: includes waiting for peers); link:",
    "  share of it the node-0 uplink carries >= 10% of its rate (tx counter sampled); ovlp: share of collective",
    "  time under compute (profiler; FSDP2's waits on its collectives are not ops, its compute row includes them)",
]


def label(row: dict) -> str:
    if row["kind"] == "paro":
        return f"PaRO {row['group']} {MODE_LABEL[row['mode']]}"
    return f"{BASELINE_LABEL.get(row['group'], row['group'])} {'eager' if row['mode'] == 'eager' else 'compiled'}"


def parse_recompile(message: str) -> tuple[str, list[tuple[str, str]]]:
    """Dynamo's recompile log message -> ("function (file:line)", [(compile id of a cache entry
    that failed, its first failed guard)]); source comments and user stacks dropped."""
    lines = message.splitlines()
    head = re.match(r"Recompiling function (\S+) in (.+):(\d+)", lines[0] if lines else "")
    where = (
        f"{head.group(1)} ({os.path.basename(head.group(2))}:{head.group(3)})" if head else (lines[0] if lines else "?")
    )
    failed = []
    for line in lines[1:]:
        m = re.match(r"\s*- (\d+/\d+): (.*)", line)
        if m:
            failed.append((m.group(1), re.sub(r"\s+#.*$", "", m.group(2)).strip()))
    return where, failed


def link_series(samples: Sequence[tuple[float, int]], rate_bps: float, threshold: float = 0.1,
                duration_ms: float | None = None) -> tuple[list[float], list[float], float]:
    """Kernel tx-counter samples (ms since the step started, bytes) -> (interval midpoints in ms,
    MB/s per interval, busy fraction): an interval is busy when it carried at least ``threshold``
    of the link rate (ACKs of incoming data alone stay far below), the fraction is of
    ``duration_ms`` (default: the sampled span)."""
    mids, rates, busy = [], [], 0.0
    for (t0, b0), (t1, b1) in zip(samples, samples[1:]):
        dt = t1 - t0
        if dt <= 0:
            continue
        bps = (b1 - b0) * 8 / (dt / 1e3)
        mids.append((t0 + t1) / 2)
        rates.append(bps / 8 / 1e6)
        if rate_bps > 0 and bps >= threshold * rate_bps:
            busy += dt
    span = duration_ms if duration_ms else (samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0)
    return mids, rates, (min(1.0, busy / span) if span > 0 else 0.0)


def _pct(x: float | None) -> str:
    return "    -" if x is None else f"{x:5.0%}"


def _ratio(a: dict, b: dict | None) -> str:
    return f"{a['tokens_per_s'] / b['tokens_per_s']:6.2f}" if b and b.get("tokens_per_s") and a.get("tokens_per_s") \
        else "     -"


def format_table(rows: list[dict], meta: dict) -> str:
    """The table: one line per variant in the worker's order, then the targets and the reasons."""
    mib = 2**20
    out = [f"\n== tools.bench --compiled: {meta['n']} ranks = {meta['n'] // meta['m']} nodes x {meta['m']}, "
           f"{meta['rate']} per link, Llama {meta['params'] / 1e6:.2f}M params, micro-batch {meta['batch']} x "
           f"{meta['seq']}, A = {meta['accum']}, backend {meta['backend']}, {meta['rounds']} rounds", ""]
    head = (f"{'variant':<32} {'tok/s':>7} {'vs eag':>6} {'vs cmp':>6} {'first s':>7} {'graphs':>6} {'recomp':>6} "
            f"{'inter MiB':>9} {'util':>5} {'busy':>5} {'link':>5} {'ovlp':>5} {'loss':>8}")
    out += [head, "-" * len(head)]
    by = {(r["group"], r["mode"]): r for r in rows}
    for r in rows:
        if r.get("error"):
            out.append(f"{label(r):<32} failed: {r['error'][:90]}")
            continue
        eager = by.get((r["group"], "eager")) if r["mode"] != "eager" else None
        comp = (
            by.get((r["group"], "compiled")) if r["kind"] == "paro" and r["mode"] not in ("eager", "compiled") else None
        )
        c = r["compiles"]
        graphs = f"{c['first_graphs']}+{c['later_graphs']}"
        recomp = f"{c['first_recompiles']}+{c['later_recompiles']}"
        inter = f"{r['inter_bytes'] / mib:9.2f}" if "inter_bytes" in r else "        -"
        tl = r.get("timeline") or {}
        out.append(f"{label(r):<32} {r['tokens_per_s']:7.0f} {_ratio(r, eager)} {_ratio(r, comp)} {r['first_s']:7.1f} "
                   f"{graphs:>6} {recomp:>6} {inter} {_pct(r.get('link_util'))} {_pct(tl.get('inter_busy_fraction'))} "
                   f"{_pct(tl.get('link_busy_fraction'))} {_pct(tl.get('overlap_fraction'))} {r['loss']:8.5f}")
    out += LEGEND
    out += _targets(by)
    for r in rows:
        if r.get("reasons"):
            out.append(f"recompile reasons, {label(r)}:")
            out += [f"  {s}" for s in dict.fromkeys(r["reasons"])][:8]
    return "\n".join(out)


def _targets(by: dict) -> list[str]:
    out = []
    for s, (vs_eager, vs_comp) in TARGETS.items():
        full, eager, comp = by.get((s, "all")), by.get((s, "eager")), by.get((s, "compiled"))
        if not full or full.get("error") or not eager or eager.get("error"):
            continue
        ok = full["tokens_per_s"] / eager["tokens_per_s"] >= vs_eager
        ratio = full["tokens_per_s"] / eager["tokens_per_s"]
        text = f"PaRO {s} compiled+all passes: {ratio:.2f}x eager (target >= {vs_eager:.2f}x)"
        if vs_comp and comp and not comp.get("error"):
            ok = ok and full["tokens_per_s"] / comp["tokens_per_s"] >= vs_comp
            text += f", {full['tokens_per_s'] / comp['tokens_per_s']:.2f}x compiled (target >= {vs_comp:.2f}x)"
        out.append(f"{text}: {'met' if ok else 'NOT met'}")
    return out


def write_timeline_png(path: str, rows: dict[str, list[tuple[float, float]]], duration_ms: float, fractions: dict,
                       series: tuple[list[float], list[float]] | None, rate_bps: float, title: str) -> str | None:
    """One step of one variant: the profiler's rows (compute, intra, inter, ...; rank 0) and, below
    on the same time axis, the node-0 uplink's measured throughput against the link rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from paro_fsdp.train.timeline import COLORS, ROWS

    names = [r for r in ROWS if r in ("compute", "intra", "inter") or rows.get(r)]
    with_link = bool(series and series[0])
    fig, axes = plt.subplots(
        2 if with_link else 1,
        1,
        figsize=(12, 0.55 * len(names) + (3.4 if with_link else 1.6)),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [len(names), 2.2] if with_link else [1]},
    )
    ax = axes[0][0]
    for y, name in enumerate(reversed(names)):
        ax.broken_barh([(a, b - a) for a, b in rows.get(name, [])], (y - 0.4, 0.8), facecolors=COLORS[name])
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.set_xlim(0, duration_ms)
    ax.grid(axis="x", alpha=0.3)
    text = " | ".join(f"{k.replace('_fraction', '').replace('_', ' ')} {v:.0%}" for k, v in sorted(fractions.items()))
    ax.set_title(f"{title}: step {duration_ms:.0f} ms\n{text}", fontsize=11)
    if with_link:
        lx = axes[1][0]
        lx.step(series[0], series[1], where="mid", color=COLORS["inter"], lw=1)
        lx.axhline(rate_bps / 8 / 1e6, color="k", ls="--", lw=0.8, label="link rate")
        lx.set_ylabel("node-0 uplink\nMB/s (tx counter)")
        lx.legend(loc="upper right", fontsize=8)
        lx.grid(alpha=0.3)
    axes[-1][0].set_xlabel("ms since the step started (rank 0)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def slug(row: dict) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label(row)).strip("_").lower()
