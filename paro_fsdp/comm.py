"""Every collective the engine issues, and the ledger that counts them.

One implementation per collective, built on the traceable ``_c10d_functional`` ops so the same
calls run eagerly and appear in compiled graphs. Bytes are counted per rank with the ring
formula of the spec (all-gather / reduce-scatter send S(k-1)/k, all-reduce 2S(k-1)/k, for a
buffer of S bytes over k ranks); this is the *logical* cost of the collective. gloo actually runs
reduce-scatter as an all-reduce, so its wire bytes are higher than counted here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ._compat import use_safe_gloo_all_gather
from .cost.collectives import CollectiveCounts, ring_bytes
from .mesh import MeshGroups
from .streams import CommStreams, active

_ops = torch.ops._c10d_functional
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DIMS = ("intra", "inter", "global")


class CommStats(CollectiveCounts):
    """Count and ring bytes per (kind, mesh dimension), per rank: the counter type of the
    spec's ledger (``cost.collectives.CollectiveCounts``), fed by the collectives as they run."""

    def record(self, kind: str, dim: str, nbytes: float, times: int = 1) -> None:
        if torch.compiler.is_compiling():  # a graph runs many times: passes/schedule.py counts graphs
            return
        super().record(kind, dim, nbytes, times)


@dataclass
class Pending:
    """The result of an issued collective; ``wait()`` before reading it.

    On a side stream (streams.py) the collective was already waited there: ``wait()`` makes the
    current stream wait for ``event``, and ``keep`` holds the input until then."""

    tensor: torch.Tensor
    issued: bool
    event: Any = None
    keep: Any = field(default=None, repr=False)
    streams: CommStreams | None = field(default=None, repr=False)

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.streams.wait(self.event)
            self.event = self.keep = None
            return self.tensor
        return _ops.wait_tensor(self.tensor) if self.issued else self.tensor


def on_side_stream(streams: CommStreams, kind: str, keep: Any, issue: Callable[[], torch.Tensor]) -> Pending:
    """Issue a collective (``issue()`` returns its functional result) on the ``kind`` side
    stream and wait for it there; the consumer waits on the event (streams.py)."""
    with streams.issue(kind) as side:
        out = _ops.wait_tensor(issue())
        event = side.record_event()
    return Pending(out, False, event, keep, streams)


class MeshComm:
    """Collectives over one mesh dimension ("intra", "inter") or all ranks ("global").

    ``all_gather / reduce_scatter / all_reduce`` issue one collective (on a side stream on a
    GPU) and return a ``Pending``; the ``functional_*`` calls under them issue it where the
    caller stands and return the functional result (``wait_tensor`` before reading). PaRO-CC
    (``paro_cc.ParoCC``) builds its phases from those, so every collective is issued and counted
    in ``stats`` here. ``dim="global"`` is the flat collective over the flattened mesh (small
    tensors: the grad-norm scalar; and the traced path's, which the graph pass turns into
    PaRO-CC)."""

    def __init__(self, groups: MeshGroups, streams: CommStreams | None = None) -> None:
        self.info = groups
        self.stats = CommStats()
        use_safe_gloo_all_gather()
        self.streams = streams  # side streams for collectives on a GPU (None on CPU): streams.py

    def _issue(self, kind: str, keep: torch.Tensor, issue: Callable[[], torch.Tensor]) -> Pending:
        streams = active(self.streams)
        if streams is None:
            return Pending(issue(), True)
        return on_side_stream(streams, kind, keep, issue)

    def _ring_bytes(self, kind: str, dim: str, numel: int, t: torch.Tensor) -> float:
        return ring_bytes(kind, numel * t.element_size(), self.info.size(dim))

    # ---- issued where the caller stands: the functional result ---------------------------------
    def functional_all_gather(self, shard: torch.Tensor, dim: str) -> torch.Tensor:
        k = self.info.size(dim)
        self.stats.record("all_gather", dim, self._ring_bytes("all_gather", dim, shard.numel() * k, shard))
        return _ops.all_gather_into_tensor(shard, k, self.info.group_names[dim])

    def functional_reduce_scatter(self, full: torch.Tensor, dim: str, *, op: str = "sum") -> torch.Tensor:
        k = self.info.size(dim)
        self.stats.record("reduce_scatter", dim, self._ring_bytes("reduce_scatter", dim, full.numel(), full))
        return _ops.reduce_scatter_tensor(full, op, k, self.info.group_names[dim])

    def functional_all_reduce(self, t: torch.Tensor, dim: str, *, op: str = "sum") -> torch.Tensor:
        self.stats.record("all_reduce", dim, self._ring_bytes("all_reduce", dim, t.numel(), t))
        return _ops.all_reduce(t, op, self.info.group_names[dim])

    # ---- on the side stream of its kind on a GPU: a Pending ------------------------------------
    def all_gather(self, shard: torch.Tensor, dim: str) -> Pending:
        """Concatenate every rank's 1-D ``shard`` in rank order along ``dim``."""
        if self.info.size(dim) == 1:
            return Pending(shard, False)
        return self._issue("gather", shard, lambda: self.functional_all_gather(shard, dim))

    def reduce_scatter(self, full: torch.Tensor, dim: str, *, op: str = "sum") -> Pending:
        """Reduce the 1-D ``full`` over ``dim`` and keep this rank's 1/k piece."""
        if self.info.size(dim) == 1:
            return Pending(full, False)
        return self._issue("reduce", full, lambda: self.functional_reduce_scatter(full, dim, op=op))

    def all_reduce(self, t: torch.Tensor, dim: str, *, op: str = "sum") -> Pending:
        if self.info.size(dim) == 1:
            return Pending(t, False)
        return self._issue("reduce", t, lambda: self.functional_all_reduce(t, dim, op=op))
