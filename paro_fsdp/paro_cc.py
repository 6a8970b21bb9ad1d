"""PaRO-CC: global collectives run as intra-group + inter-group collectives, chunked so the
phases overlap.

Why: a flat ring over all n ranks carries (n-1)/n * S across each group's one inter edge; m inter
rings (one per local index l) on 1/m of the data each carry (g-1)/g * S, the rest on the fast intra
links. Chunk c's second phase runs on the other process group while chunk c+1's first is on the wire.

Order: "flat" is the flat collective's (rank k * m + l owns block k * m + l); "nested" is the
engine's (block l * g + k is rank (k, l)'s: layout.py's NESTED), the hierarchy's natural output.
On CPU the later phases are issued inside ``wait()``, so every rank must wait in the same order
(``boundary.drive`` sees to it); on a GPU every phase is issued by the call (streams.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .comm import MeshComm, wait
from .collectives import HIER, Dim, Kind, runs_flat
from .streams import active

ORDERS = ("flat", "nested")
#: reductions gloo and NCCL both run in reduce_scatter_tensor / all_reduce
REDUCE_OPS = ("sum", "avg", "max", "min")

DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_MAX_CHUNKS = 8


@dataclass
class HierPending:
    """An issued PaRO-CC collective: ``wait()`` issues the remaining phases and returns the result."""

    _finish: Callable[[], torch.Tensor] | None
    _result: torch.Tensor | None = None
    _keep: object = field(default=None, repr=False)  # the input, held until the consumer waits (streams)
    _advance: Callable[[], None] | None = field(default=None, repr=False)

    def advance(self) -> None:
        """Wait for the first (intra) phase and issue the next without waiting: called a block after the
        issue, so a reduction's inter phase runs under the next block's backward. A no-op where the first
        phase is the slow one (all-gather) or there is one phase."""
        if self._advance is not None and self._finish is not None:
            self._advance()
        self._advance = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
            self._keep = None
            self._advance = None
        return self._result  # type: ignore[return-value]


def _done(t: torch.Tensor) -> HierPending:
    return HierPending(None, t)


def _flat(t: torch.Tensor) -> torch.Tensor:
    x = t.reshape(-1)
    return x if x.is_contiguous() else x.contiguous()


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
    """Hierarchical collectives over the mesh of ``comm``, built from its per-dimension ones.
    ``chunk_bytes``: the whole message's bytes per chunk; ``max_chunks`` caps the count (each chunk adds a
    latency per phase); ``chunks`` forces one. ``flat_below_bytes``: smaller messages run flat (0: never)."""

    def __init__(self, comm: MeshComm, chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_chunks: int = DEFAULT_MAX_CHUNKS,
                 flat_below_bytes: int = 0) -> None:
        if chunk_bytes <= 0 or max_chunks <= 0:
            raise ValueError(f"chunk_bytes and max_chunks must be positive, got {chunk_bytes}, {max_chunks}")
        if flat_below_bytes < 0:
            raise ValueError(f"flat_below_bytes must be >= 0 (0: never flat), got {flat_below_bytes}")
        self.comm, self.info = comm, comm.info
        self.chunk_bytes, self.max_chunks, self.flat_below_bytes = chunk_bytes, max_chunks, flat_below_bytes
        self._ag, self._rs = comm.functional_all_gather, comm.functional_reduce_scatter
        self._ar = comm.functional_all_reduce
        self._calls = {Kind.ALL_GATHER: self._ag, Kind.REDUCE_SCATTER: self._rs, Kind.ALL_REDUCE: self._ar}

    def _phases(self, kind: Kind, wire: str | None) -> list[Callable[..., torch.Tensor]]:
        """A global ``kind``'s phase calls in ``collectives.HIER``'s order; ``wire`` quantizes the inter one."""
        return [functools.partial(self._calls[k], dim=d, **self._on(d, wire)) for k, d in HIER[kind]]

    @staticmethod
    def _on(dim: Dim, wire: str | None) -> dict:
        return {"wire": wire} if wire is not None and dim == Dim.INTER else {}

    def _nchunks(self, nbytes: int, limit: int, chunks: int | None) -> int:
        if chunks is None:
            chunks = min(self.max_chunks, max(1, math.ceil(nbytes / self.chunk_bytes)))
        return max(1, min(chunks, max(limit, 1)))

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
        """``body()`` issues the first phase, the rest in ``wait()``; on a side stream all at once (streams.py)."""
        streams = active(self.comm.streams)  # None: later phases are issued in wait()
        if streams is None:
            return body()
        with streams.issue(kind) as side:
            result = body().wait()
            event = side.record_event()

        def finish() -> torch.Tensor:
            streams.wait(event)
            return result

        return HierPending(finish, _keep=keep)

    def all_gather(self, shard: torch.Tensor, *, order: str = "flat", chunks: int | None = None,
                   params: bool = False, parts: bool = False, wire: str | None = None) -> HierPending:
        """Every rank's ``shard`` concatenated along dim 0 (rank order per ``order``): inter, then intra
        all-gather, per chunk. ``params``: see ``MeshComm.all_gather``. ``parts`` (order "nested", 1-D): the
        chunks as they arrived (``layout.NestedPart``), which the consumer copies straight to where they go.
        ``wire``: the inter phase quantized (a message that runs flat stays in its dtype)."""
        if parts and (order != "nested" or shard.dim() != 1):
            raise ValueError("parts=True needs order='nested' and a 1-D shard")
        return self._issue("params" if params else "gather", shard,
                           lambda: self._all_gather(shard, order, chunks, parts, wire))

    def _all_gather(self, shard: torch.Tensor, order: str, chunks: int | None, parts: bool,
                    wire: str | None) -> HierPending:
        self._check(order)
        g, m = self.info.g, self.info.m
        n = g * m
        out_shape = (n * shard.shape[0], *shard.shape[1:]) if shard.dim() else (n,)
        x = _flat(shard)
        s = x.numel()

        def whole(nested: torch.Tensor) -> torch.Tensor | list:  # a NESTED result: the tensor, or its one part
            return [(0, s, nested.view(m, g, s))] if parts else nested.view(out_shape)

        if n == 1:
            return _done(whole(x.clone()))
        if g == 1 or m == 1:  # one level only: the global group *is* that level, same rank order
            dim = Dim.INTRA if g == 1 else Dim.INTER
            res = self._ag(x, dim, **self._on(dim, wire))
            return HierPending(lambda: whole(wait(res)))
        if s == 0:
            return _done(whole(x.new_empty(out_shape)))
        if runs_flat(n * s * x.element_size(), self.flat_below_bytes):
            res = self._ag(x, Dim.GLOBAL)  # flat rank order k * m + l
            if order == "nested":
                return HierPending(lambda: whole(flat_to_nested(wait(res), g, m)))
            return HierPending(lambda: wait(res).view(out_shape))
        bounds = _bounds(s, self._nchunks(n * s * x.element_size(), s, chunks))
        inter_phase, intra_phase = self._phases(Kind.ALL_GATHER, wire)
        inter = [inter_phase(x[a:b]) for a, b in bounds]  # [k][j] per chunk, all in flight

        def finish() -> torch.Tensor | list:
            intra = []
            for part in inter:  # intra phase of chunk c overlaps the inter phase of c + 1 ...
                intra.append(intra_phase(wait(part)))
            if parts:  # intra output [l][k][b - a]: chunk c's columns of the nested layout
                return [(a, b, wait(part).view(m, g, b - a)) for (a, b), part in zip(bounds, intra)]
            if len(bounds) == 1 and order == "nested":
                return wait(intra[0]).view(out_shape)  # [l][k][s] is the nested layout itself
            out = torch.empty(n * s, dtype=x.dtype, device=x.device)
            dst = self._blocks(out, s, order)
            for (a, b), part in zip(bounds, intra):
                dst[:, :, a:b].copy_(wait(part).view(m, g, b - a).transpose(0, 1))
            return out.view(out_shape)

        return HierPending(finish)

    # ---- reduce-scatter ----------------------------------------------------------------------
    def reduce_scatter(self, full: torch.Tensor, *, op: str = "sum", order: str = "flat",
                       chunks: int | None = None, wire: str | None = None) -> HierPending:
        """``full`` (dim 0 = n blocks) reduced over all ranks, this rank's block kept: intra, then inter
        reduce-scatter (``wire``: quantized), per chunk."""
        return self._issue("reduce", full, lambda: self._reduce_scatter(full, op, order, chunks, wire))

    def _reduce_scatter(self, full: torch.Tensor, op: str, order: str, chunks: int | None,
                        wire: str | None) -> HierPending:
        self._check(order, op)
        g, m = self.info.g, self.info.m
        n = g * m
        if full.dim() == 0 or full.shape[0] % n:
            raise ValueError(f"reduce_scatter needs dim 0 divisible by the world size {n}, "
                             f"got shape {tuple(full.shape)}")
        out_shape = (full.shape[0] // n, *full.shape[1:])
        x = _flat(full)
        if n == 1:
            return _done(x.clone().view(out_shape))
        if g == 1 or m == 1:
            dim = Dim.INTRA if g == 1 else Dim.INTER
            res = self._rs(x, dim, op=op, **self._on(dim, wire))
            return HierPending(lambda: wait(res).view(out_shape))
        s = x.numel() // n
        if s == 0:
            return _done(x.new_empty(out_shape))
        if runs_flat(x.numel() * x.element_size(), self.flat_below_bytes):
            res = self._rs(x if order == "flat" else nested_to_flat(x, g, m), Dim.GLOBAL, op=op)
            return HierPending(lambda: wait(res).view(out_shape))
        bounds = _bounds(s, self._nchunks(x.numel() * x.element_size(), s, chunks))
        src = self._blocks(x, s, order)  # [k][l][s]
        intra_phase, inter_phase = self._phases(Kind.REDUCE_SCATTER, wire)
        if len(bounds) == 1 and order == "nested":
            intra = [intra_phase(x, op=op)]  # the input already is [l][k][s]
        else:  # per chunk a contiguous [l][k][s_c] buffer: intra RS hands rank l its [k][s_c]
            intra = [intra_phase(src[:, :, a:b].transpose(0, 1).contiguous().view(-1), op=op) for a, b in bounds]

        inter: list[torch.Tensor] = []

        def advance() -> None:
            if not inter:
                inter.extend(inter_phase(wait(part), op=op) for part in intra)

        def finish() -> torch.Tensor:
            advance()
            if len(bounds) == 1:
                return wait(inter[0]).view(out_shape)
            out = torch.empty(s, dtype=x.dtype, device=x.device)
            for (a, b), part in zip(bounds, inter):
                out[a:b].copy_(wait(part))
            return out.view(out_shape)

        return HierPending(finish, _advance=advance)

    # ---- all-reduce --------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, *, op: str = "sum", chunks: int | None = None,
                   wire: str | None = None) -> HierPending:
        """``t`` reduced over all ranks (any shape): intra reduce-scatter, inter all-reduce of the 1/m piece
        (``wire``: quantized), intra all-gather, per chunk, pipelined."""
        return self._issue("reduce", t, lambda: self._all_reduce(t, op, chunks, wire))

    def _all_reduce(self, t: torch.Tensor, op: str, chunks: int | None, wire: str | None) -> HierPending:
        self._check("flat", op)
        g, m = self.info.g, self.info.m
        shape = t.shape
        x = _flat(t)
        if g * m == 1:
            return _done(x.clone().view(shape))
        if g == 1 or m == 1:
            dim = Dim.INTRA if g == 1 else Dim.INTER
            res = self._ar(x, dim, op=op, **self._on(dim, wire))
            return HierPending(lambda: wait(res).view(shape))
        numel = x.numel()
        if numel == 0:
            return _done(t.clone())
        if runs_flat(numel * x.element_size(), self.flat_below_bytes):
            res = self._ar(x, Dim.GLOBAL, op=op)
            return HierPending(lambda: wait(res).view(shape))
        # chunks are whole rows of m elements; only a last partial row is padded, so a tensor whose size
        # m divides moves exactly its own bytes (the ledger stays exact) and is never copied
        rows = math.ceil(numel / m)
        nchunks = self._nchunks(numel * x.element_size(), rows, chunks)
        bounds = [(a * m, min(b * m, numel)) for a, b in _bounds(rows, nchunks)]

        def piece(a: int, b: int) -> torch.Tensor:
            if (b - a) % m == 0:
                return x[a:b]
            padded = torch.zeros(math.ceil((b - a) / m) * m, dtype=x.dtype, device=x.device)
            padded[: b - a].copy_(x[a:b])
            return padded

        rs_phase, ar_phase, ag_phase = self._phases(Kind.ALL_REDUCE, wire)
        rs = [rs_phase(piece(a, b), op=op) for a, b in bounds]
        ar: list[torch.Tensor] = []

        def advance() -> None:  # every chunk's inter all-reduce in flight
            if not ar:
                ar.extend(ar_phase(wait(part), op=op) for part in rs)

        def finish() -> torch.Tensor:
            ag: list[torch.Tensor] = []
            if ar:  # advanced: the inter phases are all on the wire
                ag.extend(ag_phase(wait(part)) for part in ar)
            else:
                for c in range(len(bounds)):  # keep both links busy: chunk c's inter AR next to c-1's intra AG
                    ar.append(ar_phase(wait(rs[c]), op=op))
                    if c:
                        ag.append(ag_phase(wait(ar[c - 1])))
                ag.append(ag_phase(wait(ar[-1])))
            if len(bounds) == 1 and numel % m == 0:
                return wait(ag[0]).view(shape)
            out = torch.empty(numel, dtype=x.dtype, device=x.device)
            for (a, b), part in zip(bounds, ag):
                out[a:b].copy_(wait(part)[: b - a])
            return out.view(shape)

        return HierPending(finish, _advance=advance)


def flat_to_nested(t: torch.Tensor, g: int, m: int) -> torch.Tensor:
    """Reorder n = g * m dim-0 blocks from flat rank order (k * m + l) to nested (l * g + k)."""
    return t.reshape(g, m, -1).transpose(0, 1).reshape(t.shape)


def nested_to_flat(t: torch.Tensor, g: int, m: int) -> torch.Tensor:
    """Inverse of ``flat_to_nested``."""
    return t.reshape(m, g, -1).transpose(0, 1).reshape(t.shape)
