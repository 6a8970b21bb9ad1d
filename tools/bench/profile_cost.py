"""What one traced step of ``train_configs/llama7b_paro.toml`` (64 micro-steps of 32 layers, every
100 steps) costs the training thread, measured on CPU at that trace's size.

    python -m tools.bench.profile_cost                    # the estimate, then both measurements
    python -m tools.bench.profile_cost --fraction 0.25    # a quarter of that size (less time and memory)

Why: the profiler's own stop and export, and then (before it moved to a process of its own) the
timeline's parse and drawing, run on the training thread in ``profiler.step()`` and all scale with
the trace's event count, which a tiny CPU run hides.

1. The size: the debug trainer (4 gloo ranks) traced once with 1 and once with 2 micro-steps gives
   the events (and bytes) per micro-step and of the rest of the step; times 8 (32 layers for the
   debug model's 4) and 64 micro-steps is the 7B trace, on CPU (a GPU trace adds kernel and
   runtime events).
2. The profiler: ``build_profiler`` over a step of 64 micro-steps of that many recorded ops in all
   (small ``F.linear``s, nested as the model's ops are), once with every micro-step traced and once
   with the default ``profiling.traced_micro_steps``; the time of the ``profiler.step()`` that ends
   the traced step is what the training thread blocks for (the sink's own call, which only starts
   the drawing's process, is timed in 3).
3. The timeline: the 2-micro-step trace replicated up to that size; the time ``TimelineWriter``'s
   call takes on the calling thread, and until its drawing is written (``close``).
To measure an older checkout: ``cd /tmp && PYTHONPATH=<checkout> python <this file>`` (outside the repository,
whose folder would come first on sys.path); the script prints which code it measured.

Measured on 2 shared CPU cores (2.78 M events): the step() ending the traced step took 261-300 s with shapes
recorded and the timeline drawn on the training thread, 20.5 s now (torch's stop 18 s and export 5 s; with
shapes 46 s and 13 s); the drawing, 27 s and 5.3 GB in its own process. With 2 of the 64 micro-steps traced
(``profiling.traced_micro_steps``' default): 0.09 M events, 23 MB, step() 0.46 s where all traced took 27 s in the
same run (0.74 GB), 1.7% of it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Optional

LAYERS_7B, LAYERS_DEBUG, MICRO_7B = 32, 4, 64


def _small_trace(dump: str, micro: int) -> str:
    """Rank 0's trace of step 4 of the debug run, ``micro`` micro-steps per step (the measured checkout's train.py)."""
    import paro_fsdp

    repo = os.path.dirname(os.path.dirname(os.path.abspath(paro_fsdp.__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "train.py",
           "--job.config_file", "train_configs/debug_paro.toml", "--job.dump_folder", dump, "--training.steps", "4",
           "--training.global_batch_size", str(32 * micro), "--profiling.enable_profiling",
           "--profiling.profile_freq", "4", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]
    subprocess.run(cmd, cwd=repo, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (path,) = glob.glob(os.path.join(dump, "profile_traces", "rank0.*.pt.trace.json"))
    return path


def estimate(tmp: str) -> tuple[int, int, str]:
    """Events and bytes of a 7B 64-micro-step trace on CPU, and the 2-micro-step trace."""
    counts, path = [], ""
    for micro in (1, 2):
        path = _small_trace(os.path.join(tmp, f"micro{micro}"), micro)
        with open(path) as f:
            counts.append((len(json.load(f)["traceEvents"]), os.path.getsize(path)))
    (e1, b1), (e2, b2) = counts
    scale = LAYERS_7B // LAYERS_DEBUG
    per_micro, per_micro_b = e2 - e1, b2 - b1
    events = scale * (e1 - per_micro + MICRO_7B * per_micro)
    size = scale * (b1 - per_micro_b + MICRO_7B * per_micro_b)
    print(f"debug trace: {e1} events / {b1 / 1e6:.1f} MB with 1 micro-step, {e2} / {b2 / 1e6:.1f} MB with 2: "
          f"{per_micro} events per micro-step")
    print(f"7B, 64 micro-steps (x{scale} layers): about {events / 1e6:.2f} M events, {size / 1e9:.2f} GB "
          f"(bytes as this code records them)")
    return events, size, path


def _ops_per_iteration() -> int:
    import torch
    import torch.nn.functional as F

    x, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(100):
            F.linear(x, w, b).relu_()
    return max(1, len(prof.events()) // 100)


def _traced_step(events: int, tmp: str, traced: Optional[int]) -> tuple[int, float, float, float]:
    """One step of 64 micro-steps over ``events`` recorded ops, ``traced`` of them traced (0: all; None: an
    older checkout, which has no such key and traces all): the trace's events and bytes, the seconds
    recording it and those of the ``step()`` that ends it."""
    import torch
    import torch.nn.functional as F

    from paro_fsdp.train.config_parse import parse_args
    from paro_fsdp.train.metrics import build_profiler

    dump = os.path.join(tmp, f"synthetic{traced}")
    argv = ["--job.dump_folder", dump, "--profiling.enable_profiling", "--profiling.profile_freq", "2"]
    if traced is not None:
        argv += ["--profiling.traced_micro_steps", str(traced)]
    cfg, _ = parse_args(argv, 1)
    x, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    per_micro = max(1, events // _ops_per_iteration() // MICRO_7B)
    with build_profiler(cfg, 0, torch.device("cpu"), 0) as prof:
        micro_step = getattr(prof, "micro_step", lambda micro, n: None)  # an older checkout's profiler has none
        prof.step()  # the warm-up step
        t0 = time.perf_counter()
        for micro in range(MICRO_7B):
            micro_step(micro, MICRO_7B)
            for _ in range(per_micro):
                F.linear(x, w, b).relu_()
        t1 = time.perf_counter()
        prof.step()  # ends the traced step: stop, export, prune
        t2 = time.perf_counter()
    (trace,) = glob.glob(os.path.join(dump, "profile_traces", "rank0.*.pt.trace.json"))
    with open(trace) as f:
        n = len(json.load(f)["traceEvents"])
    size = os.path.getsize(trace)
    os.remove(trace)
    return n, size, t1 - t0, t2 - t1


def profiler_cost(events: int, tmp: str) -> None:
    """The step() ending a traced 64-micro-step step, every micro-step traced and then the default bound."""
    from paro_fsdp.train.config import Profiling

    bound = getattr(Profiling(), "traced_micro_steps", None)
    rows = {}
    for traced in (0, bound) if bound else (bound,):
        n, size, record, stop = rows[traced] = _traced_step(events, tmp, traced)
        what = "every micro-step" if not traced else f"{traced} of {MICRO_7B} micro-steps"
        print(f"profiler, {what} traced: {n / 1e6:.2f} M events, {size / 1e9:.3f} GB trace; recording the step "
              f"{record:.1f} s; training thread in the step() that ends it: {stop:.2f} s")
    if bound:
        (n0, b0, _, s0), (n1, b1, _, s1) = rows[0], rows[bound]
        print(f"profiler, bounded / all: events {n1 / n0:.3f}, bytes {b1 / b0:.3f}, step() {s1 / s0:.3f} "
              f"({s0:.2f} s -> {s1:.2f} s)")


def _replicate(src: str, events: int, out: str) -> int:
    """``src``'s step laid end to end until it has ``events`` events; streamed, never all in memory."""
    with open(src) as f:
        trace = json.load(f)
    evs = [e for e in trace["traceEvents"] if e.get("ph") != "M"]
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    (step,) = [e for e in evs if str(e.get("name", "")).startswith("ProfilerStep#")]
    span, copies = float(step["dur"]), max(1, -(-events // len(evs)))
    written = 0
    with open(out, "w") as f:
        f.write('{"traceEvents": [')
        first = True
        for e in meta + [{**step, "dur": span * copies}]:
            f.write(("" if first else ",") + json.dumps(e))
            first = False
        for i in range(copies):
            for e in evs:
                if e is not step and "ts" in e:
                    f.write("," + json.dumps({**e, "ts": float(e["ts"]) + i * span}))
                    written += 1
        f.write("]}")
    return written


def timeline_cost(src: str, events: int, tmp: str) -> None:
    from paro_fsdp.train import timeline as T

    big = os.path.join(tmp, "rank0.1.pt.trace.json")
    n = _replicate(src, events, big)
    writer = T.TimelineWriter(os.path.join(tmp, "tb_replicated"), 0, "eager", {}, {})
    t0 = time.perf_counter()
    writer(big)
    t1 = time.perf_counter()
    writer.close()
    t2 = time.perf_counter()
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"timeline: {n / 1e6:.2f} M events, {os.path.getsize(big) / 1e9:.2f} GB trace; the call on the training "
          f"thread {t1 - t0:.2f} s, drawn {t2 - t0:.1f} s after it (steps {writer.written}); peak RSS this process "
          f"{own:.1f} GB, largest child {child:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fraction", type=float, default=1.0, help="measure at this share of the 7B trace's size")
    ap.add_argument("--only", choices=("profiler", "timeline"), help="one measurement (each needs the estimate)")
    args = ap.parse_args(argv)
    import paro_fsdp

    print(f"code: {os.path.dirname(os.path.abspath(paro_fsdp.__file__))}")
    with tempfile.TemporaryDirectory(prefix="profile_cost_") as tmp:
        events, _, src = estimate(tmp)
        target = int(events * args.fraction)
        if args.only != "timeline":
            profiler_cost(target, tmp)
        if args.only != "profiler":
            timeline_cost(src, target, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
