"""Part (a): the trainer on one GPU. ``train.py`` runs as subprocesses (the gloo CPU reference and
the NCCL runs side by side, the resumed run after the one it resumes from) and their
``metrics.jsonl`` losses are compared as each pair finishes.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from .checks import COMPILE_RTOL, FAIL, LOSS_RTOL, PASS, check, compare_losses, loss_falls
from .plan import A_ENV, A_RESUME_FROM, A_STEPS, REPO, train_runs
from .report import Emitter, log_tail, read_losses, read_metric


def worker_a(emit: Emitter, device: str, workdir: Path) -> None:
    runs = train_runs(device, workdir)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 4) // 4)), **A_ENV)
    procs: dict[str, tuple[subprocess.Popen, Any, float]] = {}
    done: dict[str, dict[str, Any]] = {}

    def start(name: str) -> None:
        log = open(workdir / f"{name}.log", "w", encoding="utf-8")
        print(f"start {name}: {' '.join(f'{k}={v}' for k, v in A_ENV.items())} {shlex.join(runs[name])}", flush=True)
        procs[name] = (subprocess.Popen(runs[name], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env), log,
                       time.monotonic())

    def losses(name: str) -> dict[int, float]:
        return read_losses(workdir / name / "metrics.jsonl")

    def failed(name: str) -> Optional[str]:
        d = done[name]
        return None if d["rc"] == 0 else f"{name} exited {d['rc']}: {log_tail(workdir / f'{name}.log')}"

    def stop(signum: int, frame: Any) -> None:  # the parent's timeout: stop the trainers first
        for proc, _, _ in procs.values():
            proc.terminate()
        deadline = time.monotonic() + 10
        for proc, _, _ in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    for name in ("fp32_gloo", "fp32_nccl", "bf16_nccl", "compile_nccl"):
        start(name)
    emitted: set[str] = set()
    while procs or len(emitted) < 4:
        time.sleep(0.5)
        for name in list(procs):
            proc, log, t0 = procs[name]
            if proc.poll() is None:
                continue
            log.close()
            done[name] = {"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1)}
            del procs[name]
            print(f"{name} finished: exit {proc.returncode} in {done[name]['seconds']} s", flush=True)
            if name == "fp32_nccl":
                if proc.returncode == 0:
                    start("resume_nccl")
                else:  # nothing to resume from
                    done["resume_nccl"] = {"rc": -1, "seconds": 0.0}
        if "a.fp32" not in emitted and {"fp32_gloo", "fp32_nccl"} <= done.keys():
            emitted.add("a.fp32")
            why = failed("fp32_gloo") or failed("fp32_nccl")
            ref, gpu = losses("fp32_gloo"), losses("fp32_nccl")
            cmp = compare_losses(ref, gpu, LOSS_RTOL, steps=range(1, A_STEPS + 1))
            ok = why is None and cmp["ok"]
            text = why or (f"max rel diff {cmp['max_rel']:.1e} over {cmp['steps']} steps (step {cmp['worst_step']}); "
                           f"loss {gpu.get(1, float('nan')):.4f} -> {gpu.get(A_STEPS, float('nan')):.4f}"
                           + (f"; missing steps {cmp['missing']}" if cmp["missing"] else ""))
            emit(
                check(
                    "a",
                    "a.fp32",
                    f"fp32 losses NCCL = gloo CPU ({A_STEPS} steps)",
                    PASS if ok else FAIL,
                    text,
                    f"rel <= {LOSS_RTOL:g}",
                    compare=cmp,
                    gloo=ref,
                    nccl=gpu,
                    runs={k: done[k] for k in ("fp32_gloo", "fp32_nccl")},
                )
            )
        if "a.bf16" not in emitted and "bf16_nccl" in done:
            emitted.add("a.bf16")
            why = failed("bf16_nccl")
            got = losses("bf16_nccl")
            fall = loss_falls(got)
            ok = why is None and fall["ok"] and len(got) == A_STEPS
            text = why or (
                f"loss {fall['first']:.4f} -> {fall['last']:.4f} (mean of first / last 3 of {len(got)} steps)"
                if fall["first"] is not None
                else fall["why"]
            )
            emit(check("a", "a.bf16", "bf16 params + grads train (loss falls)", PASS if ok else FAIL, text,
                       "falls >= 5%, all finite", falls=fall, losses=got, run=done["bf16_nccl"]))
        if "a.compile" not in emitted and {"compile_nccl", "fp32_nccl"} <= done.keys():
            emitted.add("a.compile")
            why = failed("compile_nccl")
            got, eager = losses("compile_nccl"), losses("fp32_nccl")
            cmp = compare_losses(eager, got, COMPILE_RTOL, steps=range(1, A_STEPS + 1))
            ok = why is None and cmp["ok"]
            first_step = read_metric(workdir / "compile_nccl" / "metrics.jsonl", "time/step_s").get(1, float("nan"))
            text = why or (f"{len(got)} steps, max rel diff to eager {cmp['max_rel']:.1e}; first (compiling) step "
                           f"{first_step:.0f} s, run {done['compile_nccl']['seconds']:.0f} s")
            emit(check("a", "a.compile", f"--compile.enable trains ({A_STEPS} steps)", PASS if ok else FAIL, text,
                       f"rel <= {COMPILE_RTOL:g} vs eager", compare=cmp, losses=got, run=done["compile_nccl"]))
        if "a.resume" not in emitted and {"resume_nccl", "fp32_nccl"} <= done.keys():
            emitted.add("a.resume")
            why = failed("fp32_nccl") or failed("resume_nccl")
            first, resumed = losses("fp32_nccl"), losses("resume_nccl")
            steps = range(A_RESUME_FROM + 1, A_STEPS + 1)
            cmp = compare_losses(first, resumed, LOSS_RTOL, steps=steps)
            extra = sorted(set(resumed) - set(steps))
            ok = why is None and cmp["ok"] and not extra
            text = why or (
                f"steps {min(resumed, default=0)}..{max(resumed, default=0)}: max rel diff {cmp['max_rel']:.1e}"
                + (f"; unexpected steps {extra} (did not resume?)" if extra else "")
            )
            emit(check("a", "a.resume", f"resume from step {A_RESUME_FROM} reproduces {A_RESUME_FROM + 1}..{A_STEPS}",
                       PASS if ok else FAIL, text, f"rel <= {LOSS_RTOL:g}", compare=cmp, resumed=resumed,
                       run=done["resume_nccl"]))
