"""The parent side of ``gpu_check``: every part in its own subprocess and process group, (a), (b),
(d) and (e) side by side, then (c) alone, each with its timeout; a part that crashes or times out
keeps the rows it reported and fails the rest. And the first row: the versions.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from .checks import FAIL, PASS, check, version_check
from .plan import EXCLUSIVE, REPO, PartPlan
from .report import log_tail


def device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"type": device, "torch": torch.__version__}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(0), count=torch.cuda.device_count(),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            pass
    return info


def version_row(device: str) -> dict[str, Any]:
    """The table's first row: the running torch and its CUDA (and NCCL) against the supported range
    (``paro_fsdp._compat.SUPPORTED_TORCH``); FAIL outside it, on a CPU build of torch for a CUDA
    run, or when the engine does not import."""
    import torch

    name = "torch and CUDA versions against the supported range"
    cuda = torch.version.cuda
    measured = f"torch {torch.__version__}, CUDA {cuda or 'none (a CPU build)'}"
    if device == "cuda" and cuda:
        try:
            measured += ", NCCL " + ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            pass
    try:
        from paro_fsdp._compat import SUPPORTED_TORCH
    except Exception as exc:  # noqa: BLE001 - the row says why
        return check(
            "v",
            "v.torch",
            name,
            FAIL,
            f"{measured}; paro_fsdp does not import: {type(exc).__name__}: {exc}"[:300],
            "paro_fsdp._compat.SUPPORTED_TORCH",
        )
    v = version_check(torch.__version__, cuda, SUPPORTED_TORCH, device)
    return check("v", "v.torch", name, PASS if v["ok"] else FAIL, measured + (f"; {v['why']}" if v["why"] else ""),
                 f"torch {v.get('range', '?')}" + (", a CUDA build" if device == "cuda" else ""))


def _read_results(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for raw in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                pass
    return out


def _finish_part(plan: PartPlan, results: list[dict[str, Any]], why_missing: str) -> list[dict[str, Any]]:
    """The part's rows in plan order: what the worker reported, FAIL for what it did not."""
    got = {r["id"]: r for r in results}
    rows = [got.pop(cid) if cid in got else check(plan.key, cid, name, FAIL, why_missing) for cid, name in plan.checks]
    return rows + list(got.values())


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (its worker stops its own children: torchrun starts the
    trainer in a session of its own), SIGKILL after 15 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_parts(plans: list[PartPlan], workdir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the parts' subprocesses ((a), (b), (d), (e) side by side, then (c) alone), each in its own
    process group with its timeout; return the rows and per-part records."""
    rows: dict[str, list[dict[str, Any]]] = {}
    parts: dict[str, Any] = {}
    phases = [[p for p in plans if p.key not in EXCLUSIVE], [p for p in plans if p.key in EXCLUSIVE]]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    running: dict[str, tuple[PartPlan, subprocess.Popen, float, Path, Any]] = {}
    try:
        _run_phases(phases, workdir, env, running, rows, parts)
    finally:  # Ctrl-C or an error here: no part keeps running (or holding the GPU) behind our back
        for _, proc, _, _, log in running.values():
            if proc.poll() is None:
                _kill(proc)
            log.close()
    ordered = [r for p in plans for r in rows.get(p.key, [])]
    return ordered, parts


def _run_phases(phases: list[list[PartPlan]], workdir: Path, env: dict[str, str], running: dict[str, Any],
                rows: dict[str, list[dict[str, Any]]], parts: dict[str, Any]) -> None:
    for phase in phases:
        for p in phase:
            part_dir = workdir / p.key
            shutil.rmtree(part_dir, ignore_errors=True)
            part_dir.mkdir(parents=True, exist_ok=True)
            result = workdir / f"{p.key}.jsonl"
            result.unlink(missing_ok=True)
            log_path = workdir / f"{p.key}.log"
            log = open(log_path, "w", encoding="utf-8")
            proc = subprocess.Popen(
                p.worker, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            running[p.key] = (p, proc, time.monotonic(), log_path, log)
            print(f"({p.key}) started: {p.title} (timeout {p.timeout_s} s, log {log_path})", flush=True)
        while running:
            time.sleep(0.5)
            for key in list(running):
                p, proc, t0, log_path, log = running[key]
                elapsed = time.monotonic() - t0
                rc = proc.poll()
                timed_out = rc is None and elapsed > p.timeout_s
                if rc is None and not timed_out:
                    continue
                if timed_out:
                    _kill(proc)
                    rc = proc.returncode
                log.close()
                del running[key]
                results = _read_results(workdir / f"{key}.jsonl")
                if timed_out:
                    why = f"not reached: part timed out after {p.timeout_s} s"
                elif rc != 0:
                    why = f"not reached: part crashed (exit {rc}): {log_tail(log_path)}"
                else:
                    why = "not reported by the part"
                rows[key] = _finish_part(p, results, why)
                status = FAIL if any(r["status"] == FAIL for r in rows[key]) else PASS
                parts[key] = {"title": p.title, "status": status, "rc": rc, "timed_out": timed_out,
                              "seconds": round(elapsed, 1), "timeout_s": p.timeout_s, "log": str(log_path),
                              "command": shlex.join(p.worker)}
                print(f"({key}) {'timed out' if timed_out else 'finished'} after {elapsed:.0f} s: "
                      + ", ".join(f"{r['id']} {r['status']}" for r in rows[key]), flush=True)
