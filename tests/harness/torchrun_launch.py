"""A ``torchrun`` of train.py that a test can watch and hurt: read its output as it comes, find
a worker's pid by rank and restart attempt, and signal it (SIGKILL, SIGSTOP)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]


class Launch:
    def __init__(self, argv: list[str], nproc: int = 4, max_restarts: int = 0) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts), str(REPO / "train.py"), *argv]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
