"""What the trainer does when something breaks mid-run: a lost or hung rank, a non-finite step.

Why each piece exists:
- ``restart_store``: under ``torchrun --max-restarts N`` a restarted gloo group fails in
  ``connectFullMesh`` on the addresses the dead attempt left in the agent's store (torch 2.13,
  also a bare ``init_process_group``). Keys under a per-attempt prefix start every attempt
  clean; NCCL exchanges its unique id through the same store, so it gets the same treatment.
- ``collective_failure``: a dead peer or a collective timeout surfaces as a long backend
  traceback on every surviving rank; one line that says which it was, and that torchrun's
  restart resumes from the latest checkpoint, is what an operator needs at 3 a.m.
- ``report_sigterm``: when one rank fails, torchrun SIGTERMs the others within 0.1 s; a survivor
  still waiting for its own collective timeout would die without a word (or, torn down by the
  interpreter, abort from a backend thread), so it says in one line why it stopped.
- ``NonFiniteGuard``: one bad batch must not poison the fp32 masters (and every checkpoint after
  it). The loss and the gradient norm are already global (all-reduced), so every rank takes the
  same decision without another collective. The lr schedule still advances on a skipped step:
  it is a function of the step number (as torchtitan's, and as PyTorch's GradScaler recipe, which
  skips only ``optimizer.step()``), so a run with skips ends its schedule at ``training.steps``
  and a resume's lr equals the uninterrupted run's; Adam's own step count does not advance.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..checkpoint_files import dcp_causes


class TrainingStopped(RuntimeError):
    """The run cannot continue; the message is the one line ``train.py`` prints (exit status 1)."""


# ---- process group under torchrun restarts ----------------------------------------------------
def restart_store(timeout: datetime.timedelta) -> Optional[dist.Store]:
    """The store a rank started by torchrun should initialise its process group on: torchrun's
    TCPStore under the prefix ``paro/attempt<TORCHELASTIC_RESTART_COUNT>``. None outside torchrun
    (the default ``env://`` init is then right)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent_hosts_store), timeout=timeout)
    return dist.PrefixStore(f"paro/attempt{attempt}", store)


def set_collective_timeout(timeout: datetime.timedelta) -> int:
    """Apply ``timeout`` to every process group of this process, the mesh's sub-groups included
    (the engine's collectives run on those: a timeout set on the default group alone never
    fires for them). Returns how many groups took it."""
    from torch.distributed import distributed_c10d as c10d

    groups = list(getattr(getattr(c10d, "_world", None), "pg_map", {}) or [c10d._get_default_group()])
    done = 0
    for group in groups:
        try:
            c10d._set_pg_timeout(timeout, group)
            done += 1
        except (AttributeError, RuntimeError, ValueError):  # a backend without settable timeouts
            pass
    return done


# ---- a failed collective, in one line -----------------------------------------------------------
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
              "Socket closed", "NCCL communicator was aborted", "ncclRemoteError")
# matched in lower case: gloo says "Timed out waiting ... for recv", and, for the other operations
# pending on a pair that timed out, "Application timeout caused pair closure"; NCCL's watchdog
# "Watchdog caught collective operation timeout"
_TIMED_OUT = ("timed out", "timeout")


def collective_failure(exc: BaseException, rank: int, step: int, timeout_s: float) -> Optional[str]:
    """One line describing ``exc`` if it is a collective that lost its peers or timed out, else
    None (then it is a bug, and its traceback must be seen)."""
    causes = dcp_causes(exc)  # a failure inside DCP: the lowest rank's error
    if causes:
        exc = causes[0][1]
    if not isinstance(exc, (RuntimeError, dist.DistError)):
        return None
    text = str(exc)
    restart = ("under torchrun --max-restarts N the group restarts and resumes from the latest checkpoint; "
               "otherwise rerun the same command")
    if any(s in text for s in _PEER_GONE):
        return f"rank {rank} at step {step}: another rank died or closed its connection ({_first_line(text)}); {restart}"
    if any(s in text.lower() for s in _TIMED_OUT):
        return (f"rank {rank} at step {step}: a collective timed out after {timeout_s:g} s "
                f"(comm.train_timeout_seconds): another rank is hung or far slower; find it (py-spy dump, or its "
                f"last log line), raise comm.train_timeout_seconds if it is only slow; {restart}")
    return None


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= 160 else line[:157] + "..."


# ---- stopped by torchrun ------------------------------------------------------------------------
def report_sigterm(describe: Callable[[], str], write_line: Callable[[str], None]) -> Callable[[], bool]:
    """On SIGTERM: ``write_line(describe())`` once, then leave with exit status 1 (``os._exit``:
    a process group whose peer failed cannot be torn down safely). Returns ``said``: call it
    before the process writes its own last line; True: write it, and a SIGTERM after it
    (torchrun's, while this rank is still closing) ends the process without a second line;
    False: a SIGTERM's line is being written, write nothing. Call from the main thread.

    Why a thread: Python runs a signal handler only between bytecodes of the main thread, and a
    survivor is blocked in a collective's C++ wait (the GIL released) until its own timeout, by
    which time torchrun has SIGTERMed it. CPython's C-level handler writes the signal number to
    the wakeup fd at once; a daemon thread waiting on that fd reports. (A process stopped by
    SIGSTOP, or stuck in the kernel, takes no signal at all: torchrun SIGKILLs it 30 s later.)"""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    once = threading.Lock()  # held: the process said its last line (or is saying it)

    def leave() -> None:
        if once.acquire(blocking=False):
            try:
                write_line(describe())
            finally:
                os._exit(1)
        os._exit(1)

    def watch() -> None:
        while True:
            data = os.read(read_fd, 64)
            if not data:
                return
            if signal.SIGTERM in data:
                leave()

    signal.signal(signal.SIGTERM, lambda signum, frame: leave())
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=watch, name="paro-sigterm", daemon=True).start()
    return lambda: once.acquire(blocking=False)


def sigterm_line(rank: int, step: int) -> str:
    """What a rank stopped by SIGTERM says: torchrun sends it to every worker once one failed
    (that one's own line says why) and at each restart; a scheduler sends it to cancel."""
    return (f"rank {rank} at step {step}: stopped by SIGTERM (torchrun stops every rank once one fails, whose own line "
            f"says why; or the job was cancelled); under torchrun --max-restarts N the group restarts and resumes from "
            f"the latest checkpoint")


# ---- non-finite loss or gradient norm ----------------------------------------------------------
class NonFiniteGuard:
    """Decides, once per step, whether the optimizer may step: ``mode`` "skip" skips a step whose
    loss or gradient norm is NaN/inf (and stops after ``max_consecutive`` in a row, 0 = never);
    "stop" stops at the first one. Reading the two values costs one device-to-host copy per step."""

    def __init__(self, mode: str, max_consecutive: int) -> None:
        if mode not in ("skip", "stop"):
            raise ValueError(f"on_nonfinite = {mode!r}; valid: skip, stop")
        self.mode, self.max_consecutive = mode, max_consecutive
        self.consecutive = 0
        self.skipped: list[int] = []

    def allows_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, optimizer) -> bool:
        """True when the step is finite. Otherwise logs (returns the line via ``self.last``),
        and returns False or raises ``TrainingStopped``. Every rank must call it (the name of the
        offending parameter is found with one small collective, only on a bad step)."""
        finite = bool(torch.isfinite(torch.stack([loss.float(), grad_norm.float()])).all())
        if finite:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped.append(step)
        name = first_nonfinite_grad(optimizer)
        where = f"; first non-finite gradient: {name}" if name else ""
        what = f"step {step}: non-finite loss {float(loss):g} / grad norm {float(grad_norm):g}{where}"
        if self.mode == "stop":
            raise TrainingStopped(f"{what}: stopping (training.on_nonfinite = \"stop\"); the fp32 masters are those of "
                                  f"step {step - 1}; resume from the latest checkpoint, e.g. with a lower optimizer.lr, "
                                  f"or set training.on_nonfinite = \"skip\"")
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise TrainingStopped(f"{what}: {self.consecutive} non-finite steps in a row (training.max_consecutive_skips = "
                                  f"{self.max_consecutive}): stopping; the weights are those of step {step - self.consecutive}; "
                                  f"check the data and optimizer.lr, then resume from the latest checkpoint")
        self.last = f"{what}: optimizer step skipped ({self.consecutive} in a row)"
        return False


def first_nonfinite_grad(optimizer) -> Optional[str]:
    """Name of the first parameter (in model order) whose gradient shard is non-finite on any
    rank. None when none is (a NaN loss can come with finite gradients)."""
    return _first_flagged(optimizer, lambda m: m.grad)


def nonfinite_masters(optimizer) -> Optional[str]:
    """Name of the first fp32 master weight with a NaN or inf on any rank (None: all finite);
    checked before every save so a checkpoint never holds one."""
    return _first_flagged(optimizer, lambda m: m)


@torch.no_grad()
def _first_flagged(optimizer, tensor_of) -> Optional[str]:
    """One all-reduce (max) of a non-finite flag per master parameter, in model order."""
    masters = [m for g in optimizer.groups for m in g.master]
    device = masters[0].device
    flags = torch.zeros(len(masters), dtype=torch.int32, device=device)
    for i, m in enumerate(masters):
        t = tensor_of(m)
        if t is not None and t.numel():
            flags[i] = (~torch.isfinite(t)).any().to(torch.int32)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad = flags.nonzero()
    return optimizer.fqn_of[masters[int(bad[0])]] if len(bad) else None
