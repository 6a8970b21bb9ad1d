"""The collective schedule of a compiled graph: what the passes changed, as text and a timeline.

For each collective, in issue order: kind, mesh dimension, bytes, block, the node positions where
it is issued and waited, and how many compute ops (matmuls, attention) run in between: the work
that can hide the transfer. A wait right after its issue hides nothing.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

import torch.fx as fx

from paro_fsdp.collectives import Dim, Kind

from .graph import COMPUTE, GroupTable, collectives, positions


@dataclass
class Event:
    kind: str
    dim: str
    nbytes: int
    block: str
    issue: int
    wait: int
    overlap: int  # compute ops between issue and wait


def schedule(graph: fx.Graph, groups: GroupTable) -> list[Event]:
    pos = positions(graph)
    compute_at = [i for n, i in pos.items() if n.op == "call_function" and n.target in COMPUTE]
    events = []
    for c in collectives(graph, groups):
        a, b = pos[c.node], pos[c.wait]
        events.append(Event(c.kind, c.dim, c.nbytes, c.block[-1] if c.block else "<root>", a, b,
                            sum(1 for i in compute_at if a < i < b)))
    return sorted(events, key=lambda e: e.issue)


_CODE_ISSUE = re.compile(r"(buf\w+) = torch\.ops\._c10d_functional\."
                         r"(all_gather_into_tensor|reduce_scatter_tensor|all_reduce)"
                         r"\w*\.default\(.*'([^']*)'\)")
_CODE_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\w+)\)")
_CODE_COMPUTE = re.compile(r"extern_kernels\.(mm|addmm|bmm|baddbmm)\(|_scaled_dot_product|convolution")
_CODE_KIND = {"all_gather_into_tensor": Kind.ALL_GATHER, "reduce_scatter_tensor": Kind.REDUCE_SCATTER,
              "all_reduce": Kind.ALL_REDUCE}


def schedule_of_code(code: str, groups: GroupTable) -> list[Event]:
    """The collective schedule inductor actually emitted: ``schedule`` read from a graph's
    generated Python (``torch._inductor.utils.run_and_get_code``) rather than from the FX graph,
    since inductor's scheduler may reorder nodes after the passes (positions are line numbers;
    bytes and blocks are not in the code: 0 and "?")."""
    issued: dict[str, tuple[str, str, int]] = {}
    computes: list[int] = []
    events = []
    for i, line in enumerate(code.splitlines()):
        if m := _CODE_ISSUE.search(line):
            issued[m.group(1)] = (_CODE_KIND[m.group(2)], groups.get(m.group(3), ("?", None))[0], i)
        elif (m := _CODE_WAIT.search(line)) and m.group(1) in issued:
            kind, dim, at = issued.pop(m.group(1))
            events.append(Event(kind, dim, 0, "?", at, i, 0))
        elif _CODE_COMPUTE.search(line):
            computes.append(i)
    for e in events:
        e.overlap = sum(1 for c in computes if e.issue < c < e.wait)
    return sorted(events, key=lambda e: e.issue)


def summary(events: list[Event]) -> dict[str, int]:
    """Collectives per ``kind/dim``."""
    out: dict[str, int] = {}
    for e in events:
        out[f"{e.kind}/{e.dim}"] = out.get(f"{e.kind}/{e.dim}", 0) + 1
    return dict(sorted(out.items()))


def render_text(events: list[Event], title: str) -> str:
    lines = [f"# {title}: {len(events)} collectives {summary(events)}",
             f"{'#':>3} {'kind':<15}{'dim':<7}{'KiB':>10} {'issue':>6} {'wait':>6} {'overlap':>8}  block"]
    for i, e in enumerate(events):
        lines.append(f"{i:>3} {e.kind:<15}{e.dim:<7}{e.nbytes / 1024:>10.1f} {e.issue:>6} {e.wait:>6} "
                     f"{e.overlap:>8}  {e.block}")
    return "\n".join(lines)


def as_dicts(events: list[Event]) -> list[dict]:
    return [asdict(e) for e in events]


COLORS = {Dim.INTRA: "tab:blue", Dim.INTER: "tab:red", Dim.GLOBAL: "tab:purple", "?": "tab:gray"}


def render_png(before: list[Event], after: list[Event], path: str, title: str) -> None:
    """Two timelines (x = position in the graph): one bar per collective from issue to wait,
    colored by mesh dimension, labelled with its kind and block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(len(before), len(after), 1)
    fig, axes = plt.subplots(2, 1, figsize=(11, 1.6 + 0.5 * rows), sharex=True)
    short = {Kind.ALL_GATHER: "AG", Kind.REDUCE_SCATTER: "RS", Kind.ALL_REDUCE: "AR"}
    for ax, events, name in zip(axes, (before, after), ("before", "after")):
        for row, e in enumerate(events):
            ax.barh(row, max(e.wait - e.issue, 0.6), left=e.issue, color=COLORS.get(e.dim, "tab:gray"), height=0.7)
            ax.text(e.wait + 1, row, f"{short[e.kind]} {e.dim} {e.block.split('.')[-1]} (overlap {e.overlap})",
                    va="center", fontsize=7)
        ax.set_ylim(-0.8, rows - 0.2)
        ax.invert_yaxis()
        ax.set_yticks([])
        ax.set_title(f"{name} passes", fontsize=9, loc="left")
    end = max([e.wait for e in before + after] + [1])
    axes[-1].set_xlim(0, end * 1.25 + 5)
    axes[-1].set_xlabel("position in the graph (node index); overlap = compute ops between issue and wait")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
