"""Draw the engine's CUDA stream design for one block (docs/streams.png).

A schematic of the order paro_fsdp/streams.py imposes, not a measurement: block i of a GGG model
(P = G gathers and G = G reductions, both PaRO-CC, two phases each) in forward and backward. Rows
are the compute stream, the gather and reduce side streams (where the engine issues), and NCCL's
intra and inter links (where the bytes move). Arrows are the stream-side waits.

    python -m tools.stream_timeline --out docs/streams.png
"""
from __future__ import annotations

import argparse

ROWS = ["compute", "gather stream", "reduce stream", "NCCL intra", "NCCL inter"]
COLOURS = {"compute": "#4c72b0", "gather": "#55a868", "reduce": "#c44e52", "copy": "#8172b2", "wait": "#cccccc"}

# (row, start, end, label, colour key): forward of block i, then backward of block i
EVENTS = [
    # forward: block i computes while block i+1's gather runs (prefetched at block i's pre-forward)
    ("compute", 0.0, 0.6, "copy-out i", "copy"),
    ("compute", 0.6, 4.0, "forward block i", "compute"),
    ("gather stream", 0.6, 0.7, "issue AG i+1", "gather"),
    ("NCCL inter", 0.7, 2.2, "AG i+1 inter (S/m)", "gather"),
    ("gather stream", 2.2, 2.3, "wait", "wait"),
    ("NCCL intra", 2.3, 3.1, "AG i+1 intra (S)", "gather"),
    ("compute", 4.0, 4.1, "wait ev", "wait"),
    ("compute", 4.1, 4.6, "copy-out i+1", "copy"),
    # backward: block i's gradients reduce while block i-1's backward runs
    ("compute", 5.2, 8.8, "backward block i", "compute"),
    ("compute", 8.8, 9.3, "copy-in grads i", "copy"),
    ("reduce stream", 9.3, 9.4, "issue RS i", "reduce"),
    ("NCCL intra", 9.4, 10.4, "RS i intra (S)", "reduce"),
    ("reduce stream", 10.4, 10.5, "wait", "wait"),
    ("NCCL inter", 10.5, 12.0, "RS i inter (S/m)", "reduce"),
    ("compute", 9.3, 12.9, "backward block i-1", "compute"),
    ("compute", 12.9, 13.0, "wait ev", "wait"),
    ("compute", 13.0, 13.3, "acc += RS i", "copy"),
]
# (from row, x, to row, x, label): the stream-side waits that order the work
ARROWS = [
    ("compute", 0.6, "gather stream", 0.6, "wait_stream"),
    ("NCCL inter", 2.2, "gather stream", 2.2, ""),
    ("NCCL intra", 3.1, "compute", 4.0, "event"),
    ("compute", 9.3, "reduce stream", 9.3, "wait_stream"),
    ("NCCL intra", 10.4, "reduce stream", 10.4, ""),
    ("NCCL inter", 12.0, "compute", 12.9, "event"),
]


def draw(out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 4.2))
    y = {row: len(ROWS) - 1 - i for i, row in enumerate(ROWS)}
    for row, a, b, label, key in EVENTS:
        ax.barh(y[row], b - a, left=a, height=0.6, color=COLOURS[key], edgecolor="black", linewidth=0.5)
        if b - a >= 0.45:
            ax.text((a + b) / 2, y[row], label, ha="center", va="center", fontsize=7.5,
                    color="white" if key in ("compute", "reduce", "gather", "copy") else "black")
    for r0, x0, r1, x1, label in ARROWS:
        ax.annotate("", xy=(x1, y[r1]), xytext=(x0, y[r0]),
                    arrowprops=dict(arrowstyle="->", color="black", lw=0.8, shrinkA=6, shrinkB=6))
        if label:
            ax.text((x0 + x1) / 2 + 0.05, (y[r0] + y[r1]) / 2, label, fontsize=7, style="italic")
    ax.axvline(4.9, color="grey", ls=":", lw=1)
    ax.text(2.0, len(ROWS) - 0.35, "forward", ha="center", fontsize=9)
    ax.text(9.0, len(ROWS) - 0.35, "backward", ha="center", fontsize=9)
    ax.set_yticks([y[r] for r in ROWS], ROWS)
    ax.set_xticks([])
    ax.set_xlabel("time (schematic)")
    ax.set_ylim(-0.6, len(ROWS) - 0.1)
    ax.set_title("One block of a GGG model on CUDA: collectives on side streams, PaRO-CC's second phase "
                 "follows the first on the side stream, the compute stream waits only where it consumes", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/streams.png")
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
