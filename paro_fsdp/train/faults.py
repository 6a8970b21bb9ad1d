"""What the trainer does when something breaks: a lost or hung rank, a signal, a bad step, a bad config; and
what train.py's exit status and last line are. Each piece says why it exists (docs/failures.md)."""
from __future__ import annotations

import datetime
import io
import os
import select
import signal
import sys
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint_files import CheckpointError, dcp_causes, first_line
from ..collective_order import CollectiveOrderError
from .config import ConfigError
from .torchrun import config_error_exit, resume_command, shutdown_grace_s


class TrainingStopped(RuntimeError):
    """The run cannot continue; the message is the one line ``train.py`` prints (exit status 1)."""


def set_collective_timeout(timeout: datetime.timedelta) -> int:
    """Apply ``timeout`` to every process group, the mesh's sub-groups included; returns how many took it."""
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
# lower case: gloo's "Timed out waiting ... for recv" and "Application timeout caused pair closure",
# NCCL's "Watchdog caught collective operation timeout"
_TIMED_OUT = ("timed out", "timeout")
_RESTART = "under torchrun --max-restarts N the group restarts and resumes from the latest checkpoint"


def collective_failure(exc: BaseException, rank: int, step: int, timeout_s: float) -> Optional[str]:
    """One line for a collective that lost its peers or timed out (not every survivor's backend traceback); else
    None (a bug: its traceback must show)."""
    causes = dcp_causes(exc)  # a failure inside DCP: the lowest rank's error
    if causes:
        exc = causes[0][1]
    if not isinstance(exc, (RuntimeError, dist.DistError)):
        return None
    text, where, restart = str(exc), f"rank {rank} at step {step}", f"{_RESTART}; otherwise rerun the same command"
    if any(s in text for s in _PEER_GONE):
        return f"{where}: another rank died or closed its connection ({first_line(exc)}); {restart}"
    if any(s in text.lower() for s in _TIMED_OUT):
        return (f"{where}: a collective timed out after {timeout_s:g} s (comm.train_timeout_seconds): another rank "
                f"is hung or far slower; find it (py-spy dump, or its last log line), raise "
                f"comm.train_timeout_seconds if it is only slow; {restart}")
    return None


# ---- SIGTERM / SIGINT: finish the step, save it, exit 0 -------------------------------------------
class GracefulStop:
    """SIGTERM / SIGINT noted, not acted on: ``votes()`` ride the loss all-reduce. A daemon thread watches the
    wakeup fd (a main thread in a C++ wait runs no Python handler) and enforces deadlines for the agreed step (5 s
    + 3 longest steps: a dead peer must not hold up torchrun's restart) and the save (torchrun's grace less 5 s); a
    missed one, or the signal again after 2 s, writes ``describe(signum)`` once and ``os._exit(1)``s (a group with
    a failed peer cannot be torn down). ``said()`` False: a signal's line is being written."""

    def __init__(self, describe: Callable[[int], str], write_line: Callable[[str], None],
                 hard_s: Optional[float] = None) -> None:
        self.describe, self.write_line = describe, write_line
        self.hard_s = max(1.0, (shutdown_grace_s() if hard_s is None else hard_s) - 5.0)
        self.signum: Optional[int] = None
        self.t_signal = 0.0
        self.longest_step_s = 0.0  # of the steps ``agreed`` saw; 0: no step finished yet
        self.stopping = False  # the agreed step was reached: only hard_s applies now
        self._once = threading.Lock()
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self._note(signum))
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="paro-graceful-stop", daemon=True).start()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def votes(self) -> tuple[float, float]:
        """This rank's (SIGTERM, SIGINT) vote: summed over ranks in the loss all-reduce."""
        return (float(self.signum == signal.SIGTERM), float(self.signum == signal.SIGINT))

    def agreed(self, votes: tuple[int, int], world: int, step_s: float) -> Optional[str]:
        """After a step: the signal the ranks agreed to stop at (``votes``: ranks that got SIGTERM, SIGINT), or None;
        the step's time sets the deadline for the next one."""
        term, interrupt = votes
        if not term + interrupt:
            self.longest_step_s = max(self.longest_step_s, step_s)
            return None
        self.stopping = True  # the agreed step: only the save is left
        return (f"SIGTERM ({term} of {world} ranks got it)" if term >= interrupt else
                f"SIGINT ({interrupt} of {world} ranks got it)")

    def said(self) -> bool:
        return self._once.acquire(blocking=False)

    def _note(self, signum: int) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.t_signal = signum, now
        elif signum == self.signum and now - self.t_signal > 2.0:  # pressed again: stop now, unsaved
            self._leave()

    def _deadline(self) -> float:
        if self.stopping or not self.longest_step_s:
            return self.t_signal + self.hard_s
        return self.t_signal + min(self.hard_s, 5.0 + 3 * self.longest_step_s)

    def _leave(self) -> None:
        if self._once.acquire(blocking=False):
            try:
                self.write_line(self.describe(self.signum or signal.SIGTERM))
            finally:
                os._exit(1)
        os._exit(1)

    def _watch(self) -> None:
        while True:
            timeout = None if self.signum is None else max(0.0, self._deadline() - time.monotonic())
            ready, _, _ = select.select([self._read_fd], [], [], timeout)
            if ready:
                data = os.read(self._read_fd, 64)
                if not data:
                    return
                for signum in data:
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        self._note(signum)
            elif self.signum is not None and time.monotonic() >= self._deadline():
                self._leave()


def reduce_with_votes(loss_sum: torch.Tensor, stop: Optional[GracefulStop]) -> tuple[torch.Tensor, Any]:
    """The loss sum and this rank's stop vote in one all-reduce, so every rank reads the same votes at the same
    step: (the summed loss, the (SIGTERM, SIGINT) counts or None without a ``stop``)."""
    packed = torch.zeros(3, device=loss_sum.device)  # loss sum, ranks that got SIGTERM, ranks that got SIGINT
    packed[0] = loss_sum
    if stop is not None and stop.requested:
        term, interrupt = stop.votes()  # host scalars: kernel arguments, no copy, no sync
        packed[1] += term
        packed[2] += interrupt
    dist.all_reduce(packed)
    return packed[0], (packed[1:] if stop is not None else None)


def stuck_line(rank: int, step: int, signum: int, waited_s: float) -> str:
    """What a rank says when a SIGTERM / SIGINT found it unable to finish its step in time."""
    name = signal.Signals(signum).name
    return (f"rank {rank} at step {step}: stopped by {name} before the ranks could agree on a step to save "
            f"(waited {waited_s:.0f} s: another rank died or hung, and torchrun stops every rank once one fails, "
            f"whose own line says why); {_RESTART}")


# ---- non-finite loss or gradient norm ----------------------------------------------------------
class NonFiniteGuard:
    """Whether the optimizer may step ("skip": a NaN/inf loss or norm is skipped, ``max_consecutive`` in a row stop,
    0 = never; "stop": the first stops). Why: one bad batch must not poison the fp32 masters; loss and norm are
    global, so every rank decides alike without a collective, by one device-to-host copy per step."""

    def __init__(self, mode: str, max_consecutive: int) -> None:
        if mode not in ("skip", "stop"):
            raise ValueError(f"on_nonfinite = {mode!r}; valid: skip, stop")
        self.mode, self.max_consecutive = mode, max_consecutive
        self.consecutive = 0
        self.skipped: list[int] = []

    stop_votes = (0, 0)  # after allows_step: how many ranks got (SIGTERM, SIGINT) by this step (GracefulStop)

    def allows_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, model,
                    stop_votes: Optional[torch.Tensor] = None) -> bool:
        """True when the step is finite, else False (line in ``self.last``) or TrainingStopped. ``stop_votes`` lands
        in ``self.stop_votes`` by the same device-to-host copy; ``model``: whose first bad ``.grad`` is named."""
        finite = torch.isfinite(torch.stack([loss.float(), grad_norm.float()])).all()
        self.stop_votes = (0, 0)
        if stop_votes is None:
            finite = bool(finite)
        elif bool(finite & (stop_votes == 0).all()):  # the normal step: one read
            finite = True
        else:
            values = torch.cat([finite.float().reshape(1), stop_votes.float().reshape(-1)]).tolist()
            finite, self.stop_votes = bool(values[0]), tuple(int(v) for v in values[1:])
        if finite:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped.append(step)
        name = _first_flagged(model, lambda p: p.grad)  # None: a NaN loss with finite gradients
        where = f"; first non-finite gradient: {name}" if name else ""
        what = f"step {step}: non-finite loss {float(loss):g} / grad norm {float(grad_norm):g}{where}"
        if self.mode == "stop":
            raise TrainingStopped(f"{what}: stopping (training.on_nonfinite = \"stop\"); the fp32 masters are those "
                                  f"of step {step - 1}; resume from the latest checkpoint, e.g. with a lower "
                                  f"optimizer.lr, or set training.on_nonfinite = \"skip\"")
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise TrainingStopped(f"{what}: {self.consecutive} non-finite steps in a row "
                                  f"(training.max_consecutive_skips = {self.max_consecutive}): stopping; the weights "
                                  f"are those of step {step - self.consecutive}; check the data and optimizer.lr, "
                                  f"then resume from the latest checkpoint")
        self.last = f"{what}: optimizer step skipped ({self.consecutive} in a row)"
        return False


def nonfinite_masters(model) -> Optional[str]:
    """First trainable parameter with a NaN/inf on any rank, or None; checked before every save."""
    return _first_flagged(model, lambda p: p)


def _trainable(source) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of every trainable one, in order: of the model (FQNs) or of an optimizer (by place)."""
    if isinstance(source, torch.nn.Module):
        return [(n, p) for n, p in source.named_parameters() if p.requires_grad]
    return [(f"param_groups[{i}]['params'][{j}]", p) for i, g in enumerate(source.param_groups)
            for j, p in enumerate(g["params"]) if p.requires_grad]


def _local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.to_local() if t is not None and hasattr(t, "to_local") else t  # a DTensor: this rank's shard


@torch.no_grad()
def _first_flagged(source, tensor_of) -> Optional[str]:
    """One all-reduce (max) of a non-finite flag per trainable parameter (``tensor_of``: it or its ``.grad``)."""
    params = _trainable(source)
    if not params:
        return None
    flags = torch.zeros(len(params), dtype=torch.int32, device=_local(params[0][1]).device)
    for i, (_, p) in enumerate(params):
        t = _local(tensor_of(p))
        if t is not None and t.numel():
            flags[i] = (~torch.isfinite(t)).any().to(torch.int32)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad = flags.nonzero()
    return params[int(bad[0])][0] if len(bad) else None


# ---- train.py's exit status ------------------------------------------------------------------------
def error_line(message: str) -> None:
    """``train.py: error: <message>`` on stderr in one ``write`` under PIPE_BUF (4096) bytes: survivors of a lost
    peer all report at once, and ``print``'s two writes let ranks' lines run together."""
    sys.stdout.flush()
    sys.stderr.flush()
    line = " ".join(f"train.py: error: {message}".split("\n"))[:3000] + "\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # stderr replaced in-process (a capture)
        sys.stderr.write(line)
        sys.stderr.flush()
        return
    os.write(fd, line.encode("utf-8", "replace"))


def stopped_line(signal_name: str, step: int, steps: int, saved: Optional[str], save_s: float) -> str:
    """What rank 0 says when every rank agreed to stop at ``step``: where it was saved and how to resume."""
    where = (f"saved {os.path.abspath(saved)} in {save_s:.2f} s" if saved else
             "checkpoint.enable = false, so nothing was saved and a rerun starts from step 0")
    make = " (or: make train RESUME=1)" if os.environ.get("MAKELEVEL") else ""
    return (f"stopped by {signal_name} at step {step}/{steps}, which every rank finished; {where}; "
            f"resume with: {resume_command()}{make}")


def exit_status(body: Callable[[Any], int], as_script: bool) -> int:
    """``body(run)``'s exit status (it sets ``run.trainer``, closed here, and gets ``run.stop``, a ``GracefulStop``
    with ``as_script``). A config error: 2; a decision every rank made alike: rank 0's line, 1; a lost or hung
    peer: each rank's line, 1; a bug: its traceback."""
    rank = int(os.environ.get("RANK", "0"))
    had_process_group = dist.is_initialized()
    run = SimpleNamespace(trainer=None, stop=None)
    step = lambda: run.trainer.state.step if run.trainer is not None else 0  # noqa: E731
    said = lambda: True  # noqa: E731 - GracefulStop's: False while a stopped rank's own line is being written
    if as_script:
        run.stop = GracefulStop(lambda signum: stuck_line(rank, step(), signum, time.monotonic() - run.stop.t_signal),
                                error_line)
        said = run.stop.said
    failed = True
    try:
        code = body(run)
        failed = False
        return code
    except ConfigError as exc:
        if run.trainer is None and dist.is_initialized() and not had_process_group:
            dist.destroy_process_group()
        if as_script:
            return config_error_exit(str(exc), rank, error_line)
        if rank == 0:
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (TrainingStopped, CheckpointError, CollectiveOrderError) as exc:  # the same on every rank: rank 0 says it
        if said() and rank == 0:
            error_line(str(exc))
        if run.trainer is None and dist.is_initialized() and not had_process_group:
            dist.destroy_process_group()
        return 1
    except (RuntimeError, dist.DistError, CheckpointException) as exc:
        line = collective_failure(exc, rank, step(), _timeout_of(run.trainer))
        if line is None:
            raise
        if said():
            error_line(line)  # every rank: the survivors say who saw what
        return 1
    finally:
        if run.trainer is not None:
            run.trainer.close(failed=failed)


def _timeout_of(trainer: Any) -> float:
    if trainer is None:
        return 0.0
    c = trainer.cfg.comm
    return c.train_timeout_seconds if trainer.state.step > (trainer.resumed_from or 0) + 1 else c.init_timeout_seconds


def run_as_script(main: Callable[[], int]) -> None:
    """``main()`` as the process. A process group still initialised here belongs to a failed run: tearing it
    down at exit can block on a gone peer or abort (SIGABRT), so such a process leaves with ``os._exit``."""
    try:
        code = main()
    except SystemExit as exc:  # an explicit exit keeps its status
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: its traceback must be seen, then leave
        traceback.print_exc()
        code = 1
    if dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
