"""What one collective is: its kind (``Kind``) and mesh dimension (``Dim``), a global one's
phases as PaRO-CC runs them (``HIER``), a quantized one's collectives (``QUANTIZED``) and its
bytes on the wire (``wire_bytes``), the bytes one rank sends in its ring, its ring steps,
whether a global one runs flat, and ``CommStats``, the one counter of collectives.

Why one module under everything else: the engine (``comm.MeshComm``), the ledger
(``cost.ledger``), the graph passes and the cost model must use the same formula, and the
engine's counter and the ledger's must compare as equals. The cost is the *logical* ring cost
(gloo's wire bytes are higher). No torch here: the advisor is arithmetic.
"""
from __future__ import annotations

import enum
from collections import defaultdict

__all__ = ["DIMS", "HIER", "KINDS", "QBLOCK", "QUANTIZED", "WIRES", "CommStats", "Dim", "Kind", "check_wire", "hops",
           "ring_bytes", "runs_flat", "wire_bytes"]


class _Name(str, enum.Enum):
    """A name that is its string: table keys, ``CommStats`` keys and printed rows stay plain words."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Kind(_Name):
    """What a collective does; the engine calls ``MeshComm``'s method of this name."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"  # a quantized reduction's exchange (``QUANTIZED``): never a phase of the plan


class Dim(_Name):
    """Which ranks it runs over: inside the group, across groups (one rank per group), or all."""

    INTRA = "intra"
    INTER = "inter"
    GLOBAL = "global"


#: the kinds the plan names and a cluster prices one by one (an all-to-all is priced at the link's base rate)
KINDS = (Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.ALL_REDUCE)
DIMS = tuple(Dim)

#: a global collective as PaRO-CC runs it, phase by phase (the inter phase on 1/m of the message):
#: the one copy of the split, which ``paro_cc`` issues and ``cost.ledger`` counts
HIER: dict[Kind, tuple[tuple[Kind, Dim], ...]] = {
    Kind.ALL_GATHER: ((Kind.ALL_GATHER, Dim.INTER), (Kind.ALL_GATHER, Dim.INTRA)),
    Kind.REDUCE_SCATTER: ((Kind.REDUCE_SCATTER, Dim.INTRA), (Kind.REDUCE_SCATTER, Dim.INTER)),
    Kind.ALL_REDUCE: ((Kind.REDUCE_SCATTER, Dim.INTRA), (Kind.ALL_REDUCE, Dim.INTER), (Kind.ALL_GATHER, Dim.INTRA)),
}


#: how a kind runs where its wire is quantized, the collectives in order (the one copy: ``quantize`` issues
#: them, ``cost.ledger`` counts them). A reduction cannot sum int8 on the wire, so it is an all-to-all of
#: quantized pieces, each rank summing what it receives in fp32 (ZeRO++'s qgZ); an all-reduce is that,
#: then an all-gather of the summed piece, quantized again.
QUANTIZED: dict[Kind, tuple[Kind, ...]] = {
    Kind.ALL_GATHER: (Kind.ALL_GATHER,),
    Kind.REDUCE_SCATTER: (Kind.ALL_TO_ALL,),
    Kind.ALL_REDUCE: (Kind.ALL_TO_ALL, Kind.ALL_GATHER),
}
#: the end of a syncing backward's question, a byte per trainable tensor OR-ed (MAX) over all ranks:
#: which tensors some rank used (``ParoState.used_grads``: FSDP2's None for the rest)
USED: tuple[Kind, Dim] = (Kind.ALL_REDUCE, Dim.GLOBAL)

#: bits per element of each quantized wire dtype; one fp32 scale per ``QBLOCK`` elements
WIRES = {"int8": 8, "int4": 4}
QBLOCK = 256


def check_wire(wire: object, what: str = "inter_dtype") -> None:
    """The one check of a quantized wire's name (None: the working dtype, exact)."""
    if wire is not None and wire not in WIRES:
        raise ValueError(f"{what} must be one of {sorted(WIRES)} or None (exact), got {wire!r}")


def wire_bytes(wire: str, numel: float) -> float:
    """Bytes of ``numel`` elements quantized to ``wire``: the codes and one fp32 scale per block
    (int8: 1.016 bytes an element, 3.94x fewer than fp32; int4: 0.516)."""
    return -(-numel // QBLOCK) * (QBLOCK * WIRES[wire] // 8 + 4)


def ring_bytes(kind: str, nbytes: float, k: int) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``k`` ranks on a buffer of ``nbytes`` (the
    all-gather's output, the reduction's input): S(k-1)/k, doubled for an all-reduce."""
    return (2 if kind == Kind.ALL_REDUCE else 1) * nbytes * (k - 1) / k


def hops(kind: str, k: int) -> int:
    """Ring steps of ``kind`` over ``k`` ranks: k - 1, or 2(k - 1) for an all-reduce."""
    return (2 if kind == Kind.ALL_REDUCE else 1) * (k - 1)


def runs_flat(nbytes: float, flat_below_bytes: float) -> bool:
    """Whether a global collective of ``nbytes`` (the whole message) runs as one flat collective
    instead of PaRO-CC's two phases: the one rule, by which ``paro_cc`` issues and ``cost.ledger``
    counts. Flat wins where a second phase costs more than the inter bytes it saves. 0: never."""
    return 0 < nbytes < flat_below_bytes


class CommStats:
    """Count and ring bytes of collectives per (kind, mesh dimension), per rank: what ran
    (``model.comm_stats()``) or what the method says runs (``cost.ledger.traffic_of``, whose counts
    may be floats), compared through ``as_dict()``."""

    def __init__(self) -> None:
        self._count: dict[tuple[str, str], float] = defaultdict(int)
        self._bytes: dict[tuple[str, str], float] = defaultdict(float)

    def record(self, kind: str, dim: str, nbytes: float, times: float = 1) -> None:
        """Add ``times`` collectives of ``kind`` over ``dim`` that send ``nbytes`` ring bytes in all."""
        self._count[(kind, dim)] += times
        self._bytes[(kind, dim)] += nbytes

    def reset(self) -> None:
        self._count.clear()
        self._bytes.clear()

    @staticmethod
    def _select(table: dict, kind: str | None, dim: str | None) -> float:
        return sum(v for (k, d), v in table.items() if kind in (None, k) and dim in (None, d))

    def bytes(self, kind: str | None = None, dim: str | None = None) -> float:
        return self._select(self._bytes, kind, dim)

    def count(self, kind: str | None = None, dim: str | None = None) -> float:
        return self._select(self._count, kind, dim)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{"kind/dim": {"count", "bytes"}}``, sorted by key."""
        return {f"{k}/{d}": {"count": self._count[(k, d)], "bytes": self._bytes[(k, d)]}
                for (k, d) in sorted(self._count)}

    def __iadd__(self, other: "CommStats") -> "CommStats":
        for key, v in other._count.items():
            self._count[key] += v
        for key, v in other._bytes.items():
            self._bytes[key] += v
        return self

    def __repr__(self) -> str:
        rows = [f"{k:>14} {d:>6} {self._count[(k, d)]:>8g} {self._bytes[(k, d)] / 2**20:12.3f} MiB"
                for (k, d) in sorted(self._count)]
        return f"{type(self).__name__}(\n" + "\n".join(rows) + "\n)"
