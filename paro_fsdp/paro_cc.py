"""PaRO-CC: global collectives run as intra-group + inter-group collectives, chunked so the
phases overlap (spec section 4).

Why: a flat ring over all n ranks, laid out in rank order, crosses between groups on only one
edge per group, and that edge carries (n-1)/n of the data (twice that for all-reduce). Rearranged
hierarchically, the slow part moves 1/m of the data per rank in m rings (one per local index l)
that run at once, so every link out of a group is busy and each group sends
m * (g-1)/g * S/m = (g-1)/g * S between groups instead of (n-1)/n * S (all-gather, reduce-scatter;
both doubled for all-reduce), with the remaining work on the fast links inside the group:

    all-gather      = inter all-gather  -> intra all-gather
    reduce-scatter  = intra reduce-scatter -> inter reduce-scatter
    all-reduce      = intra reduce-scatter -> inter all-reduce -> intra all-gather

Each tensor is cut into chunks. Every chunk's first phase is issued at once (it needs nothing
else); ``wait()`` then walks the chunks, waiting for chunk c's phase and issuing its next phase
on the *other* process group, so the intra phase of chunk c runs while the inter phase of chunk
c+1 is still on the wire. The ``_c10d_functional`` ops are asynchronous until ``wait_tensor``,
and the intra and inter groups are separate process groups with their own worker threads, so
the two phases truly run side by side (on gloo, NCCL alike).

Semantics ("order"):
  "flat"    exactly the flat collective over mesh["inter", "intra"]._flatten(): rank
            r = k * m + l owns block r. all_gather / reduce_scatter work on dim 0 like
            all_gather_into_tensor / reduce_scatter_tensor, so results equal the flat ones
            (bit for bit for all-gather; for sums up to the order of additions).
  "nested"  the engine's layout (spec section 2, nesting rule): block l * g + k belongs to rank
            (k, l), i.e. the global shard is sub-chunk k of intra chunk l. This is the natural
            output of the hierarchy, so it saves the local transpose "flat" needs.
all_reduce is elementwise, so it has no order. Sizes need not divide the chunk count (chunks
are uneven) and all_reduce takes any numel (only a last partial row of m elements is padded).

Flat where it wins: a message below ``flat_below_bytes`` (``collectives.runs_flat``, the
one rule, which the ledger follows) is one collective over mesh["inter", "intra"]._flatten()
(dim "global"), with the nested order made by a local transpose. Measured on the emulator
(2 x 2 gloo ranks, ``tools.bench.collectives``): flat is faster below about 1 MiB at 1 Gbit/s,
and at nearly every size at 10 Gbit/s, where the second phase's pass over the CPU-bound intra
links costs more than the inter bytes it saves.

Every phase is one of ``MeshComm``'s per-dimension collectives, so it is recorded in the
model's ``CommStats`` under "intra" / "inter" like any other (bytes are exactly those of the
unchunked hierarchy; counts grow with the chunks).

How the engine uses it (param_group.py; one ``ParoCC`` per model, built on the model's
``MeshComm`` by ``paro_shard``, handed to every group as ``group.cc``): every global collective of model states is one call, on the NESTED
buffers of ``layout.FlatLayout`` ([m][g][sum_g], block (l, k) = rank (k, l)'s G buffer, one size
on every rank):
  * global all-gather of a G buffer (unshard with P=G; G -> N at the boundary):
        pending = cc.all_gather(g_flat, order="nested")   # issue_unshard: inter phase in flight
        nested = pending.wait()                            # NESTED
    then ``copy_out_nested`` (into the whole tensors) or ``nested_to_full`` (a FULL buffer).
    These use every intra index's G layout: with sizes n does not divide, intra shard l' splits
    into global shards differently from this rank's l, so this rank's own layout is not enough.
  * global reduce-scatter to a G buffer (G=G each micro-step; G=N -> OS=G at the boundary):
    ``copy_in_nested`` of the gradients (or ``full_to_nested`` of a FULL buffer), then
        shard = cc.reduce_scatter(nested, order="nested").wait()   # [sum_g], the G buffer
  * global all-reduce (G=N -> OS=N): ``cc.all_reduce(acc).wait()`` replaces intra RS + inter
    AR + intra AG; it is elementwise, so the FULL layout is untouched.
``HierPending`` has ``wait()`` like ``comm.Pending``, so it can be yielded to ``drive``. On CPU its
later phases are issued inside ``wait()``: like every collective, waits must happen in the same
order on every rank (``drive`` guarantees that). On a GPU (``streams``, see streams.py) every
phase is issued by the call itself, on the gather or reduce side stream, each phase after a
stream-side wait on the one before; ``wait()`` only makes the consumer's stream wait for the
last one. Issuing later phases from ``wait()`` there would queue them behind all the compute the
CPU had issued by then, exposing the whole second phase.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .comm import MeshComm
from .collectives import runs_flat
from .streams import active

_ops = torch.ops._c10d_functional

ORDERS = ("flat", "nested")
#: reductions gloo and NCCL both run in reduce_scatter_tensor / all_reduce
REDUCE_OPS = ("sum", "avg", "max", "min")

DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_MAX_CHUNKS = 8


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _ops.wait_tensor(t)


@dataclass
class HierPending:
    """An issued PaRO-CC collective. The first phase of every chunk is already in flight;
    ``wait()`` drives the remaining phases (overlapping them across chunks) and returns the
    result. Same contract as ``comm.Pending``: call ``wait()`` exactly where the result is needed
    — every rank must call it in the same order relative to its other collectives, because the
    later phases are *issued* inside ``wait()``."""

    _finish: Callable[[], torch.Tensor] | None
    _result: torch.Tensor | None = None
    issued: bool = field(default=True)
    _keep: object = field(default=None, repr=False)  # the input, held until the consumer waits (streams)

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
            self._keep = None
        return self._result  # type: ignore[return-value]

    @property
    def tensor(self) -> torch.Tensor:
        """The result (waits); mirrors ``Pending.tensor`` for code that reads it after wait."""
        return self.wait()


def _done(t: torch.Tensor) -> HierPending:
    return HierPending(None, t, issued=False)


def _bounds(total: int, chunks: int) -> list[tuple[int, int]]:
    """Split range(total) into ``chunks`` nearly equal, non-empty, contiguous pieces."""
    chunks = max(1, min(chunks, total)) if total else 1
    base, extra = total // chunks, total % chunks  # not divmod: dynamo rejects it on SymInts in backward
    out, start = [], 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        out.append((start, start + size))
        start += size
    return out


class ParoCC:
    """Hierarchical collectives over the 2D ("inter", "intra") mesh of ``comm``, built from its
    per-dimension collectives (so they are counted in ``comm.stats`` and run on its streams).

    ``chunk_bytes``: target bytes of the *whole* message per chunk (all-gather output,
    reduce-scatter input, all-reduce tensor); ``max_chunks`` caps the count, since every chunk
    adds a latency term per phase. ``chunks`` forces a count (benchmarks, tests).
    ``flat_below_bytes``: messages smaller than this run as one flat collective over all ranks
    (``collectives.runs_flat``, which the ledger follows too); 0, the default: never.
    """

    def __init__(self, comm: MeshComm, chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_chunks: int = DEFAULT_MAX_CHUNKS,
                 flat_below_bytes: int = 0) -> None:
        if chunk_bytes <= 0 or max_chunks <= 0:
            raise ValueError(f"chunk_bytes and max_chunks must be positive, got {chunk_bytes}, {max_chunks}")
        if flat_below_bytes < 0:
            raise ValueError(f"flat_below_bytes must be >= 0 (0: never flat), got {flat_below_bytes}")
        self.comm = comm
        self.info = comm.info
        self.chunk_bytes = chunk_bytes
        self.max_chunks = max_chunks
        self.flat_below_bytes = flat_below_bytes

    def runs_flat(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` goes as one flat collective (the eager and the
        compiled path both ask here, so both run it the same way)."""
        return runs_flat(nbytes, self.flat_below_bytes)

    @property
    def stats(self):
        return self.comm.stats

    @property
    def streams(self):
        """Side streams on a GPU (streams.py); None: later phases are issued in ``wait()``."""
        return self.comm.streams

    # ---- helpers ---------------------------------------------------------------------------
    def _nchunks(self, nbytes: int, limit: int, chunks: int | None) -> int:
        if chunks is None:
            chunks = min(self.max_chunks, max(1, math.ceil(nbytes / self.chunk_bytes)))
        return max(1, min(chunks, max(limit, 1)))

    def _ag(self, x: torch.Tensor, dim: str) -> torch.Tensor:
        return self.comm.functional_all_gather(x, dim)

    def _rs(self, x: torch.Tensor, dim: str, op: str) -> torch.Tensor:
        return self.comm.functional_reduce_scatter(x, dim, op=op)

    def _ar(self, x: torch.Tensor, dim: str, op: str) -> torch.Tensor:
        return self.comm.functional_all_reduce(x, dim, op=op)

    @staticmethod
    def _check(order: str, op: str | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if op is not None and op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")

    def _blocks(self, flat: torch.Tensor, s: int, order: str) -> torch.Tensor:
        """View a buffer of n blocks of ``s`` elements as [k][l][s] (rank (k, l)'s block)."""
        g, m = self.info.g, self.info.m
        return flat.view(g, m, s) if order == "flat" else flat.view(m, g, s).transpose(0, 1)

    # ---- all-gather --------------------------------------------------------------------------
    def _issue(self, kind: str, keep: torch.Tensor, body: Callable[[], HierPending]) -> HierPending:
        """``body()`` issues the first phase and returns the rest in ``wait()``; on a side stream
        the rest is issued at once there, and the consumer waits on an event (streams.py)."""
        streams = active(self.streams)
        if streams is None:
            return body()
        with streams.issue(kind) as side:
            result = body().wait()
            event = side.record_event()

        def finish() -> torch.Tensor:
            streams.wait(event)
            return result

        return HierPending(finish, _keep=keep)

    def all_gather(self, shard: torch.Tensor, *, order: str = "flat", chunks: int | None = None) -> HierPending:
        """Concatenate every rank's ``shard`` along dim 0 (rank order per ``order``):
        inter all-gather, then intra all-gather, per chunk."""
        return self._issue("gather", shard, lambda: self._all_gather(shard, order, chunks))

    def _all_gather(self, shard: torch.Tensor, order: str, chunks: int | None) -> HierPending:
        self._check(order)
        g, m = self.info.g, self.info.m
        n = g * m
        out_shape = (n * shard.shape[0], *shard.shape[1:]) if shard.dim() else (n,)
        x = shard.reshape(-1)
        if not x.is_contiguous():
            x = x.contiguous()
        if n == 1:
            return _done(x.clone().view(out_shape))
        if g == 1 or m == 1:  # one level only: the global group *is* that level, same rank order
            res = self._ag(x, "intra" if g == 1 else "inter")
            return HierPending(lambda: _wait(res).view(out_shape))
        s = x.numel()
        if s == 0:
            return _done(x.new_empty(out_shape))
        if self.runs_flat(n * s * x.element_size()):
            res = self._ag(x, "global")  # flat rank order k * m + l
            return HierPending(lambda: (_wait(res) if order == "flat" else flat_to_nested(_wait(res), g, m)).view(out_shape))
        bounds = _bounds(s, self._nchunks(n * s * x.element_size(), s, chunks))
        inter = [self._ag(x[a:b], "inter") for a, b in bounds]  # [k][j] per chunk, all in flight

        def finish() -> torch.Tensor:
            intra = []
            for part in inter:  # intra phase of chunk c overlaps the inter phase of c + 1 ...
                intra.append(self._ag(_wait(part), "intra"))
            if len(bounds) == 1 and order == "nested":
                return _wait(intra[0]).view(out_shape)  # [l][k][s] is the nested layout itself
            out = torch.empty(n * s, dtype=x.dtype, device=x.device)
            dst = self._blocks(out, s, order)
            for (a, b), part in zip(bounds, intra):
                dst[:, :, a:b].copy_(_wait(part).view(m, g, b - a).transpose(0, 1))
            return out.view(out_shape)

        return HierPending(finish)

    # ---- reduce-scatter ----------------------------------------------------------------------
    def reduce_scatter(self, full: torch.Tensor, *, op: str = "sum", order: str = "flat",
                       chunks: int | None = None) -> HierPending:
        """Reduce ``full`` (dim 0 = n blocks) over all ranks and keep this rank's block:
        intra reduce-scatter, then inter reduce-scatter, per chunk."""
        return self._issue("reduce", full, lambda: self._reduce_scatter(full, op, order, chunks))

    def _reduce_scatter(self, full: torch.Tensor, op: str, order: str, chunks: int | None) -> HierPending:
        self._check(order, op)
        g, m = self.info.g, self.info.m
        n = g * m
        if full.dim() == 0 or full.shape[0] % n:
            raise ValueError(f"reduce_scatter needs dim 0 divisible by the world size {n}, got shape {tuple(full.shape)}")
        out_shape = (full.shape[0] // n, *full.shape[1:])
        x = full.reshape(-1)
        if not x.is_contiguous():
            x = x.contiguous()
        if n == 1:
            return _done(x.clone().view(out_shape))
        if g == 1 or m == 1:
            res = self._rs(x, "intra" if g == 1 else "inter", op)
            return HierPending(lambda: _wait(res).view(out_shape))
        s = x.numel() // n
        if s == 0:
            return _done(x.new_empty(out_shape))
        if self.runs_flat(x.numel() * x.element_size()):
            res = self._rs(x if order == "flat" else nested_to_flat(x, g, m), "global", op)
            return HierPending(lambda: _wait(res).view(out_shape))
        bounds = _bounds(s, self._nchunks(x.numel() * x.element_size(), s, chunks))
        src = self._blocks(x, s, order)  # [k][l][s]
        if len(bounds) == 1 and order == "nested":
            intra = [self._rs(x, "intra", op)]  # the input already is [l][k][s]
        else:  # per chunk a contiguous [l][k][s_c] buffer: intra RS hands rank l its [k][s_c]
            intra = [self._rs(src[:, :, a:b].transpose(0, 1).contiguous().view(-1), "intra", op) for a, b in bounds]

        def finish() -> torch.Tensor:
            inter = [self._rs(_wait(part), "inter", op) for part in intra]
            if len(bounds) == 1:
                return _wait(inter[0]).view(out_shape)
            out = torch.empty(s, dtype=x.dtype, device=x.device)
            for (a, b), part in zip(bounds, inter):
                out[a:b].copy_(_wait(part))
            return out.view(out_shape)

        return HierPending(finish)

    # ---- all-reduce --------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, *, op: str = "sum", chunks: int | None = None) -> HierPending:
        """Reduce ``t`` over all ranks (any shape and size): intra reduce-scatter, inter
        all-reduce of the 1/m piece, intra all-gather, per chunk, three phases pipelined."""
        return self._issue("reduce", t, lambda: self._all_reduce(t, op, chunks))

    def _all_reduce(self, t: torch.Tensor, op: str, chunks: int | None) -> HierPending:
        self._check("flat", op)
        g, m = self.info.g, self.info.m
        shape = t.shape
        x = t.reshape(-1)
        if not x.is_contiguous():
            x = x.contiguous()
        if g * m == 1:
            return _done(x.clone().view(shape))
        if g == 1 or m == 1:
            res = self._ar(x, "intra" if g == 1 else "inter", op)
            return HierPending(lambda: _wait(res).view(shape))
        numel = x.numel()
        if numel == 0:
            return _done(t.clone())
        if self.runs_flat(numel * x.element_size()):
            res = self._ar(x, "global", op)
            return HierPending(lambda: _wait(res).view(shape))
        # chunks are whole rows of m elements (the intra reduce-scatter splits each into m
        # pieces); only a last partial row is padded, so a tensor whose size m divides moves
        # exactly its own bytes (the ledger stays exact) and is never copied
        rows = math.ceil(numel / m)
        bounds = [(a * m, min(b * m, numel)) for a, b in _bounds(rows, self._nchunks(numel * x.element_size(), rows, chunks))]

        def piece(a: int, b: int) -> torch.Tensor:
            if (b - a) % m == 0:
                return x[a:b]
            padded = torch.zeros(math.ceil((b - a) / m) * m, dtype=x.dtype, device=x.device)
            padded[: b - a].copy_(x[a:b])
            return padded

        rs = [self._rs(piece(a, b), "intra", op) for a, b in bounds]

        def finish() -> torch.Tensor:
            ar: list[torch.Tensor] = []
            ag: list[torch.Tensor] = []
            for c in range(len(bounds)):  # keep both links busy: chunk c's inter AR next to c-1's intra AG
                ar.append(self._ar(_wait(rs[c]), "inter", op))
                if c:
                    ag.append(self._ag(_wait(ar[c - 1]), "intra"))
            ag.append(self._ag(_wait(ar[-1]), "intra"))
            if len(bounds) == 1 and numel % m == 0:
                return _wait(ag[0]).view(shape)
            out = torch.empty(numel, dtype=x.dtype, device=x.device)
            for (a, b), part in zip(bounds, ag):
                out[a:b].copy_(_wait(part)[: b - a])
            return out.view(shape)

        return HierPending(finish)


def flat_to_nested(t: torch.Tensor, g: int, m: int) -> torch.Tensor:
    """Reorder n = g * m dim-0 blocks from flat rank order (k * m + l) to nested (l * g + k)."""
    n = g * m
    blk = t.reshape(n, -1)
    return blk.view(g, m, -1).transpose(0, 1).reshape(t.shape)


def nested_to_flat(t: torch.Tensor, g: int, m: int) -> torch.Tensor:
    """Inverse of ``flat_to_nested``."""
    n = g * m
    blk = t.reshape(n, -1)
    return blk.view(m, g, -1).transpose(0, 1).reshape(t.shape)
