"""What the trainer needs of torchrun beyond its environment: a store that a restarted attempt can use, its
grace period and command line, and a configuration error told once (docs/failures.md)."""
from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
import time
from typing import Callable, Optional

import torch.distributed as dist


# ---- process group under torchrun restarts ----------------------------------------------------
def restart_store(timeout: datetime.timedelta) -> Optional[dist.Store]:
    """torchrun's TCPStore under ``paro/attempt<N>`` for the process group; None outside torchrun (``env://``).
    Why: a gloo group restarted by ``torchrun --max-restarts`` fails on the addresses the dead attempt left in
    the store; keys under a per-attempt prefix start clean."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent_hosts_store), timeout=timeout)
    return dist.PrefixStore(f"paro/attempt{attempt}", store)


# ---- SIGTERM / SIGINT: how long torchrun waits, and the command that resumes ------------------------
def shutdown_grace_s() -> float:
    """torchrun's SIGTERM-to-SIGKILL grace: ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (all a worker can read) or 30 s."""
    try:
        return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    except ValueError:
        return 30.0


def resume_command() -> str:
    """The command that resumes this run (torchrun's, read from the parent process, or ``python train.py``'s),
    without ``--job.fresh`` (which would delete the checkpoint it resumes from)."""
    def without_fresh(args: list[str]) -> list[str]:
        out, after_flag = [], False
        for a in args:
            if after_flag and a.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                after_flag = False  # the bare flag's value
                continue
            after_flag = a == "--job.fresh"
            if not after_flag and not a.startswith("--job.fresh="):
                out.append(a)
        return out

    cmd: Optional[list[str]] = None
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            parent = []
        for i, a in enumerate(parent):  # python .../torchrun ARGS, or python -m torch.distributed.run ARGS
            if os.path.basename(a) == "torchrun" or (a == "torch.distributed.run" and i and parent[i - 1] == "-m"):
                cmd = ["torchrun"] + parent[i + 1:]
                break
        if cmd is None:
            cmd = ["torchrun", "...", os.path.basename(sys.argv[0])] + sys.argv[1:]
    else:
        cmd = ["python", sys.argv[0]] + sys.argv[1:]
    return shlex.join(without_fresh(cmd))


# ---- a configuration error under torchrun ---------------------------------------------------------
def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited child torchrun has not reaped yet is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:  # gone, or no /proc: nothing to wait for
        return False


def config_error_exit(line: str, rank: int, write_line: Callable[[str], None], wait_s: float = 60.0) -> int:
    """Rank 0 writes ``line`` (also to torchrun's error file and store), waits ``wait_s`` for its node's ranks to ack
    it (they return 0 silently) and returns 2; a rank with another error or no answer writes its own line. Why:
    torchrun's summary lists every failed rank and may SIGTERM them before rank 0 said why."""
    store = _agent_store()
    node0 = os.environ.get("GROUP_RANK", "0") == "0"
    if rank == 0:
        write_line(line)
        _write_error_file(line)
        if store is None:
            return 2
        store.set("config_error", line)
        others = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1
        deadline = time.monotonic() + wait_s
        while others > 0 and store.add("config_error_acks", 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)
        # rank 0 fails last: after the acknowledged ranks' processes have exited 0 (on a loaded node
        # that takes longer than torchrun's 0.1 s poll), else torchrun lists them as failures too
        acked = store.add("config_error_acks", 0)  # each acknowledged rank set its pid first
        keys = [f"config_error_pid{i}" for i in range(others)] if acked >= others > 0 else []
        pids = [int(p) for p in store.multi_get(keys)] if keys else []
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # torchrun's poll sees their exit first
        return 2
    if store is None:
        return 2
    said = _wait_key(store, "config_error", wait_s)
    if said is not None and said == line:
        if node0:
            store.set(f"config_error_pid{store.add('config_error_pids', 1) - 1}", str(os.getpid()))
            store.add("config_error_acks", 1)
            return 0
        if os.environ.get("LOCAL_RANK") == "0":
            write_line(line)
        return 2
    write_line(line)
    _write_error_file(line)
    return 2


def _agent_store() -> Optional[dist.Store]:
    """A client of torchrun's store under this attempt's prefix; None outside torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None  # rank 0 would host it (restart_store): before the process group there is none to reach
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=30))
    except (RuntimeError, ValueError, dist.DistError):
        return None
    return dist.PrefixStore(f"paro/attempt{attempt}/", store)


def _wait_key(store: dist.Store, key: str, wait_s: float) -> Optional[str]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if store.check([key]):
            return store.get(key).decode("utf-8", "replace")
        time.sleep(0.05)
    return None


def _write_error_file(line: str) -> None:
    """torchrun's per-worker error file (ErrorHandler's format): its summary shows ``py_callstack``, the one line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"train.py: error: {line}"
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass
