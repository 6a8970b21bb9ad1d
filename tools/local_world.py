"""The one launcher of local worlds: a function on N local gloo ranks in fresh processes, every
rank's result collected (``run_local_world``), and ``train.py`` under torchrun, watched and hurt
by a test (``Torchrun``).

Why one module: the local CPU calibration (``tools.calibrate --nproc``), ``tools.bench.advisor_check``,
the tests' worlds (``tests/harness/dist_harness.py``) and the stream tests the GPU check runs all
need the same few lines (a free port, one process per rank, results through a queue read before
join, one failure fails the world). Process start costs seconds per rank on a small machine, so
callers run many cases inside one world.

Ranks are forked from one fork server per parent process that has torch imported once: a spawned
rank spent ~2 s importing torch, a 4-rank world 8 s on 2 cores; forked, 0.2 s. The server runs
with ``OMP_NUM_THREADS=1``, as the ranks do, and a rank takes the parent's environment as it is
when the world starts (not as it was when the server started). On CUDA (``device="cuda"``) the
ranks are spawned instead (a fork after anything touched the CUDA driver breaks CUDA in the
child) and all of them drive GPU 0: the stream tests run four ranks on one GPU over gloo.
"""
from __future__ import annotations

import importlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional
from unittest import mock

__all__ = ["run_local_world", "free_port", "Torchrun", "losses_by_attempt"]

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once in the fork server; what a rank needs beyond them it imports itself
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "paro_fsdp"]


def _context(device: str) -> Any:
    """The multiprocessing context ranks start from: a fork server with ``PRELOAD`` imported
    (spawn on CUDA)."""
    import multiprocessing.forkserver

    import torch.multiprocessing as mp

    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, OMP_NUM_THREADS="1"):  # read once, when the server's OpenMP runtime loads
        multiprocessing.forkserver.ensure_running()
    return ctx


def _worker(rank: int, world: int, port: int, target: str, payload: Any, queue: Any, env: dict[str, str],
            one_gpu: bool) -> None:
    os.environ.clear()  # a forked rank has the fork server's environment: the parent's, as it is now
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0" if one_gpu else str(rank), OMP_NUM_THREADS="1")
    if one_gpu:  # every rank on GPU 0 (DeviceMesh would pick cuda:LOCAL_RANK otherwise), loopback between them
        os.environ.update(LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        module, fn = target.split(":")
        result = getattr(importlib.import_module(module), fn)(payload)
        buf = io.BytesIO()
        torch.save(result, buf)  # tensors by value: shared memory dies with the worker
        queue.put((rank, "ok", buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_local_world(world: int, target: str, payload: Any = None, timeout: float = 900, *, device: str = "cpu",
                    env: Optional[dict[str, str]] = None) -> list[Any]:
    """Run ``module:function(payload)`` on ``world`` local gloo ranks (one thread each; on
    ``device="cuda"`` spawned, all on GPU 0); return every rank's result, in rank order. ``env``:
    set in the ranks' environment before they start (before a spawned rank imports torch).

    A rank that dies (a signal, an abort) or raises fails the world with RuntimeError: nothing
    is retried."""
    import torch

    ctx = _context(device)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ, **(env or {}))
    procs = [ctx.Process(target=_worker, args=(r, world, port, target, payload, queue, env, device == "cuda"))
             for r in range(world)]
    with mock.patch.dict(os.environ, env):  # a spawned interpreter starts with the parent's environment
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            try:
                rank, status, value = queue.get(timeout=timeout)
            except Exception:  # queue.Empty: a rank hangs
                errors.append(f"no result within {timeout:.0f} s")
                break
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 5)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
    if errors:
        errors.append(f"rank exit codes: {codes}")
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


class Torchrun:
    """A ``torchrun`` of train.py that a test can watch and hurt: read its output as it comes, find
    a worker's pid by rank and restart attempt, and signal it (SIGKILL, SIGSTOP)."""

    def __init__(self, argv: list[str], nproc: int = 4, max_restarts: int = 0) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts), str(REPO / "train.py"), *argv]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 180) -> tuple[int, float]:
        """Index and time of the first output line from ``after`` on that matches ``pattern``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(after, len(self.lines)):
                if rx.search(self.lines[i][1]):
                    return i, self.lines[i][0]
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line matching {pattern!r} (torchrun rc {self.proc.poll()}):\n{self.output()[-6000:]}")

    def worker_pid(self, rank: int, attempt: int, timeout: float = 60) -> int:
        """The pid of the worker of ``rank`` in restart attempt ``attempt`` (a child of torchrun)."""
        deadline = time.monotonic() + timeout
        want = {f"RANK={rank}", f"TORCHELASTIC_RESTART_COUNT={attempt}"}
        while time.monotonic() < deadline:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    if ppid != self.proc.pid:
                        continue
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = set(f.read().decode(errors="replace").split("\0"))
                except (OSError, ValueError, IndexError):
                    continue
                if want <= env:
                    return int(pid)
            time.sleep(0.05)
        raise AssertionError(f"no worker of rank {rank} in attempt {attempt}")

    def signal(self, rank: int, attempt: int, sig: int) -> int:
        pid = self.worker_pid(rank, attempt)
        os.kill(pid, sig)
        return pid

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reader.join(timeout=5)


def losses_by_attempt(metrics_jsonl: str) -> list[dict[int, float]]:
    """metrics.jsonl's (step, loss) records split into runs: a step that does not follow the
    previous one starts a new attempt."""
    import json

    runs: list[dict[int, float]] = []
    last: Optional[int] = None
    with open(metrics_jsonl) as f:
        for line in f:
            rec = json.loads(line)
            if last is None or rec["step"] <= last:
                runs.append({})
            runs[-1][rec["step"]] = rec["loss/train"]
            last = rec["step"]
    return runs
