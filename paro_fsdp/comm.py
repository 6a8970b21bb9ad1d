"""Every collective the engine issues, counted as it runs.

One implementation per collective, on the traceable ``_c10d_functional`` ops so the same calls
run eagerly and appear in compiled graphs, each counted with ``collectives.ring_bytes``. A move
the plan sends quantized (``wire``) runs ``quantize.py``'s collectives, built on these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from . import quantize
from ._compat import use_safe_gloo_all_gather
from .collectives import CommStats, Kind, ring_bytes
from .mesh import MeshGroups
from .streams import CommStreams, active

_ops = torch.ops._c10d_functional


def wait(result: Any) -> torch.Tensor:
    """A functional collective's result, waited for (a quantized one's, dequantized)."""
    return result.wait() if isinstance(result, quantize.Deferred) else _ops.wait_tensor(result)


@dataclass
class Pending:
    """The result of an issued collective; ``wait()`` before reading it. On a side stream
    (streams.py), ``wait()`` makes the current stream wait for ``event``; ``keep`` holds the input."""

    tensor: torch.Tensor
    issued: bool
    event: Any = None
    keep: Any = field(default=None, repr=False)
    streams: CommStreams | None = field(default=None, repr=False)

    def advance(self) -> None:
        """One phase only: nothing to put on the wire before ``wait()`` (see ``Work``)."""

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.streams.wait(self.event)
            self.event = self.keep = None
            return self.tensor
        return wait(self.tensor) if self.issued else self.tensor


class Work(Protocol):
    """Work in flight, the one type the engine holds across hooks: an issued collective
    (``Pending``) or PaRO-CC's phases (``paro_cc.HierPending``). ``advance()`` puts its next
    phase on the wire without waiting; ``wait()`` finishes it and returns the result."""

    def advance(self) -> None: ...

    def wait(self) -> torch.Tensor: ...


def on_side_stream(streams: CommStreams, kind: str, keep: Any, issue: Callable[[], torch.Tensor]) -> Pending:
    """Issue a collective (``issue()`` returns its functional result) on the ``kind`` side
    stream and wait for it there; the consumer waits on the event (streams.py)."""
    with streams.issue(kind) as side:
        out = wait(issue())
        event = side.record_event()
    return Pending(out, False, event, keep, streams)


class BufferPool:
    """Flat buffers handed back after a collective consumed them, taken again by the next one of
    the same size. Why: a CPU has no caching allocator, and a fresh block-sized buffer costs a page
    fault per 4 KiB (the kernel zeroes each page), every gather and reduction of every micro-step.
    Only eager CPU runs use it (``MeshComm.pool`` is None with side streams: CUDA's caching
    allocator reuses memory, and streams.py's lifetimes stay as written; the traced path never
    takes). It keeps one idle buffer per size and is emptied at the end of every backward
    (``ParoState.end_backward``): what it holds beyond the old engine's buffers at any moment is at
    most one buffer of a size not in flight then, and nothing between micro-steps or steps."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements, contents undefined."""
        got = self.free.get((numel, dtype, device))
        return got.pop() if got else torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """``t`` (from ``take``) is no longer read or written by anyone."""
        idle = self.free.setdefault((t.numel(), t.dtype, t.device), [])
        if not idle:  # a second idle one of a size is freed
            idle.append(t)

    def clear(self) -> None:
        self.free.clear()


class MeshComm:
    """Collectives over one mesh dimension ("intra", "inter") or all ranks ("global", flat).

    ``all_gather / reduce_scatter / all_reduce`` issue one (on a side stream on a GPU) and return
    a ``Pending``; the ``functional_*`` calls under them, from which PaRO-CC builds its phases,
    issue it where the caller stands. Every collective is issued and counted in ``stats`` here."""

    def __init__(self, groups: MeshGroups, streams: CommStreams | None = None) -> None:
        self.info = groups
        self.stats = CommStats()
        use_safe_gloo_all_gather()
        self.streams = streams  # side streams for collectives on a GPU (None on CPU): streams.py
        self.pool = BufferPool() if streams is None else None

    def _issue(self, kind: str, dim: str, keep: torch.Tensor, issue: Callable[[], Any]) -> Pending:
        if self.info.size(dim) == 1:  # nothing to exchange: the input is the result
            return Pending(keep, False)
        streams = active(self.streams)
        if streams is None:
            return Pending(issue(), True)
        return on_side_stream(streams, kind, keep, issue)

    def _count(self, kind: str, dim: str, numel: int, t: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # a graph runs many times: passes/schedule.py counts graphs
            return
        self.stats.record(kind, dim, ring_bytes(kind, numel * t.element_size(), self.info.size(dim)))

    # ---- issued where the caller stands: the functional result (``wait`` it) -------------------
    # ``wire`` (a quantized dtype, ``collectives.WIRES``): the move runs through ``quantize.py``
    def functional_all_gather(self, shard: torch.Tensor, dim: str, out: torch.Tensor | None = None,
                              wire: str | None = None) -> Any:
        if wire is not None:
            return quantize.all_gather(self, shard, dim, wire)
        k = self.info.size(dim)
        self._count(Kind.ALL_GATHER, dim, shard.numel() * k, shard)
        if out is not None:  # into a given buffer (eager: a pooled one)
            return _ops.all_gather_into_tensor_out(shard, k, self.info.group_names[dim], out=out)
        return _ops.all_gather_into_tensor(shard, k, self.info.group_names[dim])

    def functional_reduce_scatter(self, full: torch.Tensor, dim: str, *, op: str = "sum",
                                  wire: str | None = None) -> Any:
        if wire is not None:
            _check_sum(op)
            return quantize.reduce_scatter(self, full, dim, wire)
        k = self.info.size(dim)
        self._count(Kind.REDUCE_SCATTER, dim, full.numel(), full)
        return _ops.reduce_scatter_tensor(full, op, k, self.info.group_names[dim])

    def functional_all_reduce(self, t: torch.Tensor, dim: str, *, op: str = "sum", wire: str | None = None) -> Any:
        if wire is not None:
            _check_sum(op)
            return quantize.all_reduce(self, t, dim, wire)
        self._count(Kind.ALL_REDUCE, dim, t.numel(), t)
        return _ops.all_reduce(t, op, self.info.group_names[dim])

    def functional_all_to_all(self, x: torch.Tensor, dim: str) -> torch.Tensor:
        """``x``'s k equal pieces, piece j to rank j of ``dim``; piece j of the result is rank j's."""
        k = self.info.size(dim)
        self._count(Kind.ALL_TO_ALL, dim, x.numel(), x)
        split = [x.numel() // k] * k
        return _ops.all_to_all_single(x, split, split, self.info.group_names[dim])

    # ---- on the side stream of its kind on a GPU: a Pending ------------------------------------
    def all_gather(self, shard: torch.Tensor, dim: str, *, params: bool = False,
                   out: torch.Tensor | None = None, wire: str | None = None) -> Pending:
        """Concatenate every rank's 1-D ``shard`` in rank order along ``dim`` (into ``out`` where
        given). ``params``: a micro-step's parameter gather, which waits only for earlier
        copy-outs (streams.py)."""
        return self._issue("params" if params else "gather", dim, shard,
                           lambda: self.functional_all_gather(shard, dim, out, wire))

    def reduce_scatter(self, full: torch.Tensor, dim: str, *, op: str = "sum", wire: str | None = None) -> Pending:
        """Reduce the 1-D ``full`` over ``dim`` and keep this rank's 1/k piece."""
        return self._issue("reduce", dim, full, lambda: self.functional_reduce_scatter(full, dim, op=op, wire=wire))

    def all_reduce(self, t: torch.Tensor, dim: str, *, op: str = "sum", wire: str | None = None) -> Pending:
        return self._issue("reduce", dim, t, lambda: self.functional_all_reduce(t, dim, op=op, wire=wire))


def _check_sum(op: str) -> None:
    if op != "sum":
        raise ValueError(f"a quantized reduction sums (op='sum'), got op={op!r}: reduce in the working dtype instead")
