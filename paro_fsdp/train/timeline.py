"""Each profiled step's timeline as a TensorBoard image: per rank, when compute and the intra-, inter-group
and global collectives ran, from the step's torch.profiler trace (rows, fractions, cuts: docs/trainer.md).

Why: PaRO's schedules exist to run collectives under compute and keep the slow inter link busy, and the
TensorBoard profiler plugin no longer renders. A collective's group: on NCCL, the kernels' "Process Group
Name" args (``group_dims``); on gloo, its fixed worker threads (``gloo_threads``).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

Intervals = list[tuple[float, float]]
ROWS = ("compute", "intra", "inter", "global", "other", "wait")
COLORS = {"compute": "#1f77b4", "intra": "#2ca02c", "inter": "#ff7f0e", "global": "#9467bd", "other": "#7f7f7f",
          "wait": "#d62728"}
_DESC = {"mesh_intra": "intra", "mesh_inter": "inter", "default_pg": "global"}
_COMM_OPS = ("_c10d_functional::", "c10d::", "record_param_comms", "gloo:", "nccl:")
PAUSE_MARK, RESUME_MARK = "paro::pause#", "paro::resume"  # metrics.StepProfiler writes them


@dataclass
class Timeline:
    step: int  # N of the trace's ProfilerStep#N range
    duration: float  # ms, untraced time left out
    rows: dict[str, Intervals]  # ROWS -> merged intervals, ms from the step's start (untraced time left out)
    cuts: list[tuple[float, int]] = field(default_factory=list)  # (ms, micro-steps not traced) where time was cut


def merge(iv: Intervals, gap: float = 0.0) -> Intervals:
    """Sorted, overlaps joined; ``gap`` (a pixel) also closes shorter gaps: a 7B step has a million ops."""
    out: Intervals = []
    for a, b in sorted(iv):
        if out and a - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def measure(iv: Intervals) -> float:
    return sum(b - a for a, b in merge(iv))


def intersect(x: Intervals, y: Intervals) -> Intervals:
    x, y, out, i, j = merge(x), merge(y), [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Intervals, y: Intervals) -> Intervals:
    """One sweep over both (a 7B step's trace has millions of ops and tens of thousands of collective calls)."""
    out, y, j = [], merge(y), 0
    for a, b in merge(x):
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            if y[k][0] > a:
                out.append((a, y[k][0]))
            a = max(a, y[k][1])
            k += 1
        if b > a:
            out.append((a, b))
    return out


def _dim(args: Mapping[str, Any], group_dims: Mapping[str, str]) -> Optional[str]:
    name, desc = args.get("Process Group Name"), args.get("Process Group Description")
    if name is not None and str(name) in group_dims:
        return group_dims[str(name)]
    return _DESC.get(str(desc)) if desc is not None else None


def parse(trace: Mapping[str, Any], thread_dims: Mapping[int, str] = {},
          group_dims: Mapping[str, str] = {}) -> Optional[Timeline]:
    """The profiled step of a torch.profiler Chrome trace, or None when no step did work (the closing trace)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        return None
    step = max(steps, key=lambda e: e["dur"])
    t0, t1, main = float(step["ts"]), float(step["ts"]) + float(step["dur"]), step["tid"]
    rows: dict[str, Intervals] = {r: [] for r in ROWS}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:  # on a GPU: NCCL kernels on their streams, every other kernel is compute
        t1 = max([t1] + [float(e["ts"]) + float(e["dur"]) for e in kernels if float(e["ts"]) >= t0])
        for e in kernels:
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            if str(e["name"]).lower().startswith("nccl"):
                rows[_dim(e.get("args", {}), group_dims) or "other"].append(span)
            else:
                rows["compute"].append(span)
    else:
        ops, calls = [], []
        for e in events:
            name, span = str(e.get("name", "")), (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            if name.startswith("gloo:"):
                rows[thread_dims.get(e["tid"]) or _dim(e.get("args", {}), group_dims) or "other"].append(span)
            elif e["tid"] == main and e is not step and not name.startswith((PAUSE_MARK, RESUME_MARK)):
                if name.startswith(_COMM_OPS):
                    calls.append(span)
                    if name == "_c10d_functional::wait_tensor":
                        rows["wait"].append(span)
                elif e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
                    ops.append(span)
        rows["compute"] = subtract(ops, calls)
    if not any(rows[r] for r in ROWS if r != "compute") and measure(rows["compute"]) == 0:
        return None
    gaps = _paused(events, main, t0, t1)
    traced = subtract([(t0, t1)], [(a, b) for a, b, _ in gaps])

    def shift(t: float) -> float:  # ms since the step started, the gaps before t cut out
        return (t - t0 - sum(b - a for a, b, _ in gaps if b <= t)) / 1e3

    rows = {r: merge([(shift(a), shift(b)) for a, b in intersect(iv, traced)]) for r, iv in rows.items()}
    cuts = [(shift(a), skipped) for a, _, skipped in gaps]
    return Timeline(int(str(step["name"]).split("#")[1]), measure(traced) / 1e3, rows, cuts)


def _paused(events: list[dict], main: Any, t0: float, t1: float) -> list[tuple[float, float, int]]:
    """(start, end, micro-steps skipped) of each pause (us): from the pause mark, or the end of the last event
    that began before it and ended before the resume (a kernel still running), to the resume mark."""
    marks = sorted((float(e["ts"]), e) for e in events if e["tid"] == main and t0 <= float(e["ts"]) <= t1
                   and str(e.get("name", "")).startswith((PAUSE_MARK, RESUME_MARK)))
    gaps, pause = [], None
    for ts, e in marks:
        name = str(e["name"])
        if name.startswith(PAUSE_MARK):
            pause = (ts + float(e["dur"]), int(name[len(PAUSE_MARK):] or 0))
        elif pause is not None:
            start = max([pause[0]] + [float(x["ts"]) + float(x["dur"]) for x in events
                                      if float(x["ts"]) < pause[0] and float(x["ts"]) + float(x["dur"]) < ts])
            gaps.append((min(start, ts), ts, pause[1]))
            pause = None
    return gaps


def fractions(tl: Timeline) -> dict[str, float]:
    """The module docstring's fractions (``overlap_fraction`` only when some collective ran)."""
    r, dur = tl.rows, tl.duration or 1.0
    comm = r["intra"] + r["inter"] + r["global"] + r["other"]
    out = {"inter_busy_fraction": measure(r["inter"] + r["global"]) / dur,
           "intra_busy_fraction": measure(r["intra"] + r["global"]) / dur,
           "compute_fraction": measure(r["compute"]) / dur}
    if measure(comm) > 0:
        out["overlap_fraction"] = measure(intersect(comm, r["compute"])) / measure(comm)
    return out


def render(tl: Timeline, title: str, width_px: int = 1200):
    """The timeline as an RGB uint8 image (HWC): a row per kind that occurs (compute, intra, inter always)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in ROWS if r in ("compute", "intra", "inter") or tl.rows[r]]
    f = fractions(tl)
    text = " | ".join(f"{k.replace('_fraction', '').replace('_', ' ')} {v:.0%}" for k, v in sorted(f.items()))
    fig = Figure(figsize=(width_px / 100, 0.6 * len(rows) + 1.6), dpi=100)  # large type: cards scale it down
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for y, row in enumerate(reversed(rows)):
        ax.broken_barh([(a, b - a) for a, b in merge(tl.rows[row], tl.duration / width_px)], (y - 0.4, 0.8),
                       facecolors=COLORS[row])
    ax.set_yticks(range(len(rows)), list(reversed(rows)), fontsize=13)
    ax.tick_params(axis="x", labelsize=12)
    for x, skipped in tl.cuts:  # where untraced micro-steps were cut out
        ax.axvline(x, color="black", linestyle="--", linewidth=1.5)
        ax.annotate(f"{skipped} micro-steps not traced", (x, len(rows) - 0.6), xytext=(4, 0),
                    textcoords="offset points", fontsize=11, va="top",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    ax.set_xlim(0, tl.duration)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("ms since the step started" + (" (untraced micro-steps cut out)" if tl.cuts else ""), fontsize=12)
    ax.set_title(f"{title}\n{text}", fontsize=14)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def group_dims(groups: Any, world_name: str) -> dict[str, str]:
    """c10d group name -> row of a ``MeshGroups``; the flat all-ranks groups are "global" (or the one link crossed)."""
    flat = "global" if groups.g > 1 and groups.m > 1 else ("inter" if groups.g > 1 else "intra")
    out = {world_name: flat, groups.group_names["global"]: flat}
    for dim, size in (("intra", groups.m), ("inter", groups.g)):
        if size > 1:
            out[groups.group_names[dim]] = dim
    return out


def gloo_threads(dims: Mapping[str, str], delay_s: float = 0.03) -> dict[int, str]:
    """Gloo worker thread id -> dim (``dims``: group name -> dim); collective, once per process (threads stay).
    Per group each rank in turn joins late, so the others' pending all-reduces occupy every worker thread."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    todo, seen = [], set()
    for name, dim in dims.items():
        pg = _resolve_process_group(name)
        if pg.size() > 1 and id(pg) not in seen and dist.get_backend(pg) == "gloo":
            seen.add(id(pg))
            todo.append((dim, pg, getattr(pg._get_backend(torch.device("cpu")).options, "_threads", 2)))
    if not todo:
        return {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i, (dim, pg, threads) in enumerate(todo):
            x = torch.zeros(threads)
            with torch.profiler.record_function(f"paro_probe#{i}"):
                for leader in range(pg.size()):
                    if pg.rank() == leader:
                        time.sleep(delay_s)
                    for w in [dist.all_reduce(x[j:j + 1], group=pg, async_op=True) for j in range(threads)]:
                        w.wait()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    finally:
        os.unlink(path)
    windows = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in events
               if str(e.get("name", "")).startswith("paro_probe#")}
    out: dict[int, str] = {}
    for e in events:
        if str(e.get("name", "")).startswith("gloo:"):
            for i, (a, b) in windows.items():
                if a <= e["ts"] <= b:
                    out[e["tid"]] = todo[i][0]
    return out


def draw(trace_path: str, log_dir: str, rank: int, mode: str, thread_dims: Mapping[int, str],
         group_dims: Mapping[str, str], step_offset: int = 1) -> Optional[int]:
    """A trace's image ``timeline/rank{r}`` and fraction scalars at step N + step_offset, in a new event file
    of ``log_dir``; the step, or None for the closing trace. tensorboard's own writer: no torch import."""
    import io

    from PIL import Image
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    with open(trace_path) as f:
        tl = parse(json.load(f), thread_dims, group_dims)
    if tl is None:
        return None
    step = tl.step + step_offset
    image = render(tl, f"rank {rank} | step {step} | {mode}")
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    values = [Summary.Value(tag=f"timeline/rank{rank}", image=Summary.Image(
        height=image.shape[0], width=image.shape[1], colorspace=3, encoded_image_string=png.getvalue()))]
    values += [Summary.Value(tag=f"timeline/{name}", simple_value=v) for name, v in fractions(tl).items()]
    writer = EventFileWriter(log_dir)
    writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
    writer.close()
    return step


# Runs this file alone: no package import, so no torch (seconds per trace and rank)
_RUN_FILE = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"


class TimelineWriter:
    """The profiler's trace sink, which starts a process per drawing: a 7B trace's 0.75 GB of JSON takes tens of
    seconds to parse, holding the GIL if in a thread. ``close`` waits for the drawings."""

    def __init__(self, log_dir: str, rank: int, mode: str, thread_dims: Mapping[int, str],
                 group_dims: Mapping[str, str], step_offset: int = 1) -> None:
        self.rank = rank
        self.spec = {"log_dir": log_dir, "rank": rank, "mode": mode, "thread_dims": dict(thread_dims),
                     "group_dims": dict(group_dims), "step_offset": step_offset}
        self.jobs: list[tuple[str, subprocess.Popen]] = []
        self.written: list[int] = []  # steps drawn, as their processes are reaped

    def __call__(self, trace_path: str) -> None:
        self._reap(wait=False)
        try:  # its own session: a Ctrl-C to the trainer's process group lets a started drawing finish
            self.jobs.append((trace_path, subprocess.Popen(
                [sys.executable, "-c", _RUN_FILE, os.path.abspath(__file__), json.dumps(self.spec), trace_path],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True)))
        except OSError as exc:  # a picture must never stop a training run
            print(f"[paro] rank {self.rank}: no timeline image for {trace_path}: {type(exc).__name__}: {exc}",
                  flush=True)

    def _reap(self, wait: bool) -> None:
        running = []
        for path, job in self.jobs:
            if not wait and job.poll() is None:
                running.append((path, job))
                continue
            out, _ = job.communicate()
            self.written += [int(line) for line in out.split()]
            if job.returncode:  # killed (out of memory?): its own report never came
                print(f"[paro] rank {self.rank}: no timeline image for {path}: the drawing exited with status "
                      f"{job.returncode}", flush=True)
        self.jobs = running

    def close(self, wait: bool = True) -> None:
        """``wait=False`` (a stop, which torchrun times): drawings still running finish on their own."""
        if wait:
            self._reap(wait=True)


def _draw_main(spec_json: str, trace_path: str) -> None:
    with contextlib.suppress(OSError):
        os.nice(10)  # the training ranks' data loaders and launch threads come first
    spec = json.loads(spec_json)
    spec["thread_dims"] = {int(tid): dim for tid, dim in spec["thread_dims"].items()}
    try:
        step = draw(trace_path, **spec)
    except Exception as exc:  # one line, never a traceback: the training run goes on
        print(f"[paro] rank {spec['rank']}: no timeline image for {trace_path}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return
    if step is not None:
        try:
            print(step, flush=True)
        except BrokenPipeError:  # the trainer stopped without waiting: the image is written all the same
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    _draw_main(*sys.argv[1:3])
