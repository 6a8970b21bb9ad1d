"""What the eager engine keeps in flight across hooks: the step boundary's reductions under the
last backward, and the pushes of the updated parameters under the next forward.

Why: PaRO's headline strategies (IIG, NIG, NII) move their inter-group bytes once per step, at the
boundary, where nothing computes under them (FSDP2's HSDP hides its all-reduce under the last
backward). So each block's reduction to the OS level starts as its gradient becomes final, and
after the update each push is queued: the next forward's root starts them and each block's
pre-forward waits for its own, like a prefetch (nothing stays in flight between steps).

Bounds: a queue holds at most ``limit_bytes`` of started sequences (at least one). Order: every
rank starts, advances and finishes entries at the same hooks in FIFO order, so collectives match
across ranks. A push is deferred only where no forward collective shares its process group
(``push_dims``), so one rank that starts them early (``wait_for_params``) cannot reorder them
against the forward's gathers.
"""
from __future__ import annotations

from dataclasses import dataclass

from .boundary import Steps, drive
from .param_group import ParoParamGroup

#: default bound of each queue: bytes of the buffers its started collectives hold
IN_FLIGHT_BYTES = 256 << 20


@dataclass
class _Entry:
    group: ParoParamGroup
    steps: Steps
    nbytes: int
    pending: object = None  # the collective it waits on next; None: not started yet
    started: bool = False


class InFlight:
    """A FIFO of a step's per-group collective sequences, at most ``limit_bytes`` started."""

    def __init__(self, limit_bytes: int = IN_FLIGHT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.entries: list[_Entry] = []

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, group: ParoParamGroup) -> bool:
        return any(e.group is group for e in self.entries)

    @property
    def started_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.started)

    def queue(self, group: ParoParamGroup, steps: Steps, nbytes: int) -> None:
        self.entries.append(_Entry(group, steps, nbytes))

    def fill(self, finish_oldest: bool = False) -> None:
        """Start queued sequences in order while under the bound (``finish_oldest``: make room by
        finishing the oldest started ones)."""
        for e in list(self.entries):
            if e.started:
                continue
            if self.started_bytes and self.started_bytes + e.nbytes > self.limit_bytes:
                if not finish_oldest:
                    return
                while self.started_bytes and self.started_bytes + e.nbytes > self.limit_bytes:
                    self._drain(next(i for i, x in enumerate(self.entries) if x.started) + 1)
            e.started = True
            try:
                e.pending = next(e.steps)
            except StopIteration:
                self.entries.remove(e)

    def advance(self) -> None:
        """Issue the next phase of every started multi-phase collective (``HierPending.advance``)."""
        for e in self.entries:
            if e.started and e.pending is not None:
                e.pending.advance()

    def finish(self, group: ParoParamGroup | None = None) -> bool:
        """Run the sequences up to ``group``'s (None: all) to their end, then start more; whether any ran."""
        if not self.entries or (group is not None and group not in self):
            return False
        self._drain(len(self.entries) if group is None else
                    next(i for i, e in enumerate(self.entries) if e.group is group) + 1)
        self.fill()
        return True

    def _drain(self, upto: int) -> None:
        done, self.entries = self.entries[:upto], self.entries[upto:]
        drive([e.steps for e in done])  # started ones resume at their wait; the others start here, in order


def has_boundary_traffic(group: ParoParamGroup) -> bool:
    """Whether the group's reduction to the OS level runs a collective (all but G = OS = G)."""
    return bool(group.trainable and group.plan.boundary)


def boundary_bytes(group: ParoParamGroup) -> int:
    """Its input at the G level (the result, at the OS level, is the master gradient itself)."""
    return group.t_layout.numel(group.strategy.g) * group.mp.grad_dtype.itemsize


def push_bytes(group: ParoParamGroup) -> int:
    """Its gathered result at the P level."""
    return group.t_layout.numel(group.strategy.p) * group.mp.param_dtype.itemsize


def push_dims(group: ParoParamGroup) -> frozenset[str]:
    """The process groups a group's push runs on (empty: a local copy)."""
    return group.plan.dims("push") if group.trainable else frozenset()


def forward_dims(group: ParoParamGroup) -> frozenset[str]:
    """The process groups a group's forward all-gather runs on."""
    return group.plan.dims("gather")
