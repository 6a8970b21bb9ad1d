"""Every collective the engine issues, and the ledger that counts them.

One implementation per collective, built on the traceable ``_c10d_functional`` ops so the same
calls run eagerly and appear in compiled graphs. Bytes are counted per rank with the ring
formula of the spec (all-gather / reduce-scatter send S(k-1)/k, all-reduce 2S(k-1)/k, for a
buffer of S bytes over k ranks); this is the *logical* cost of the collective. gloo actually runs
reduce-scatter as an all-reduce, so its wire bytes are higher than counted here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .cost.collectives import CollectiveCounts, ring_bytes
from .mesh import MeshInfo, mesh_device
from .streams import CommStreams, active, streams_for

if TYPE_CHECKING:
    from .paro_cc import ParoCC

_ops = torch.ops._c10d_functional
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DIMS = ("intra", "inter", "global")


# ---- gloo: functional all-gathers through the single-tensor path --------------------------------
# torch 2.13's gloo backend runs the functional all-gather (``_c10d_functional.all_gather_into_tensor``,
# which c10d routes to ``allgather_into_tensor_coalesced``) in a work item that corrupts the heap
# or hangs when it is in flight while another process group also has work in flight: exactly
# PaRO-CC's overlap of an inter and an intra phase, and prefetching. A 4-rank loop of
# concurrent gathers on both mesh dimensions dies with "malloc(): unaligned tcache chunk
# detected" within a few hundred iterations (tests/test_gloo_concurrency.py). The same gather
# issued through ``dist.all_gather_single(async_op=True)`` (gloo's single-tensor all-gather)
# survives it. So on CPU the functional op's kernel is that call, with its work registered for
# ``wait_tensor`` exactly as the C++ kernel does: same op, same graphs, same semantics, for eager
# and compiled code alike; other devices keep torch's kernel.
_GLOO_LIB: torch.library.Library | None = None


def _group(group_name) -> dist.ProcessGroup:
    return group_name if isinstance(group_name, dist.ProcessGroup) else _resolve_process_group(group_name)


def _gather_into(out: torch.Tensor, shard: torch.Tensor, group_name) -> torch.Tensor:
    work = dist.all_gather_single(out, shard.contiguous(), group=_group(group_name), async_op=True)
    torch._C._distributed_c10d._register_work(out, work)
    return out


def _all_gather_cpu(shard: torch.Tensor, group_size: int, group_name) -> torch.Tensor:
    out = shard.new_empty((shard.shape[0] * group_size, *shard.shape[1:]))
    return _gather_into(out, shard, group_name)


def _all_gather_out_cpu(shard: torch.Tensor, group_size: int, group_name, *, out: torch.Tensor) -> torch.Tensor:
    return _gather_into(out, shard, group_name)


def _all_gather_coalesced_cpu(shards: list[torch.Tensor], group_size: int, group_name) -> list[torch.Tensor]:
    return [_all_gather_cpu(s, group_size, group_name) for s in shards]


def use_safe_gloo_all_gather() -> None:
    """Install the CPU kernels above (once per process; idempotent)."""
    global _GLOO_LIB
    if _GLOO_LIB is not None:
        return
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", _all_gather_cpu, "CPU")
    lib.impl("all_gather_into_tensor_out", _all_gather_out_cpu, "CPU")
    lib.impl("all_gather_into_tensor_coalesced", _all_gather_coalesced_cpu, "CPU")
    _GLOO_LIB = lib


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

    Global collectives of model states go through ``cc`` (PaRO-CC, ``paro_cc.py``): chunked
    hierarchical intra + inter collectives on the same ops, recorded in the same ``stats``.
    ``dim="global"`` here is the flat collective over the flattened mesh (small tensors: the
    grad-norm scalar)."""

    def __init__(self, info: MeshInfo) -> None:
        from .paro_cc import ParoCC  # paro_cc imports CommStats from here

        self.info = info
        self.stats = CommStats()
        use_safe_gloo_all_gather()
        # side streams for collectives on a GPU (None on CPU): streams.py
        self.streams = streams_for(mesh_device(info)) if info.mesh is not None else None
        # the model's one PaRO-CC instance (shared by its groups, counting into ``stats``); a plain
        # attribute, since compiled code reads it (dynamo cannot trace cached_property's lock)
        self.cc: ParoCC = ParoCC(info, stats=self.stats, streams=self.streams)

    def _issue(self, kind: str, keep: torch.Tensor, issue: Callable[[], torch.Tensor]) -> Pending:
        streams = active(self.streams)
        if streams is None:
            return Pending(issue(), True)
        return on_side_stream(streams, kind, keep, issue)

    def _ring_bytes(self, kind: str, dim: str, numel: int, t: torch.Tensor) -> float:
        return ring_bytes(kind, numel * t.element_size(), self.info.size(dim))

    def all_gather(self, shard: torch.Tensor, dim: str) -> Pending:
        """Concatenate every rank's 1-D ``shard`` in rank order along ``dim``."""
        k = self.info.size(dim)
        if k == 1:
            return Pending(shard, False)
        self.stats.record("all_gather", dim, self._ring_bytes("all_gather", dim, shard.numel() * k, shard))
        return self._issue("gather", shard, lambda: _ops.all_gather_into_tensor(shard, k, self.info.group_names[dim]))

    def reduce_scatter(self, full: torch.Tensor, dim: str) -> Pending:
        """Sum the 1-D ``full`` over ``dim`` and keep this rank's 1/k piece."""
        k = self.info.size(dim)
        if k == 1:
            return Pending(full, False)
        self.stats.record("reduce_scatter", dim, self._ring_bytes("reduce_scatter", dim, full.numel(), full))
        return self._issue("reduce", full, lambda: _ops.reduce_scatter_tensor(full, "sum", k, self.info.group_names[dim]))

    def all_reduce(self, t: torch.Tensor, dim: str, op: str = "sum") -> Pending:
        k = self.info.size(dim)
        if k == 1:
            return Pending(t, False)
        self.stats.record("all_reduce", dim, self._ring_bytes("all_reduce", dim, t.numel(), t))
        return self._issue("reduce", t, lambda: _ops.all_reduce(t, op, self.info.group_names[dim]))
