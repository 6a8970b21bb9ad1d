"""What one collective costs: the bytes a rank sends, the ring steps, the time on a link, and
the counter every ledger of collectives uses.

Why one module: the engine's ledger (``comm.MeshComm``, ``paro_cc.ParoCC``), the spec's ledger
(``paro_fsdp.ledger``), the compiler passes (``passes/graph.py``, ``passes/runtime.py``), the
cost model (``cost/predict.py``) and the calibration (``cost/calibrate.py``) must all price a
collective the same way; each used to write the formula itself.

Ring cost per rank of a collective over k ranks on a buffer of S bytes (the full, gathered
size): all-gather and reduce-scatter send S(k-1)/k in k-1 ring steps, all-reduce 2S(k-1)/k in
2(k-1). On a link of bus bandwidth B per GPU and latency a per ring step it takes
steps x a + ring bytes / B (the alpha-beta model). This is the *logical* cost: gloo runs
reduce-scatter as an all-reduce, so its wire bytes are higher (calibration measures each kind
on its own, ``Link.per_kind``).

Nothing here imports torch or the engine, so every layer can use it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["DIMS", "KINDS", "CollectiveCounts", "Link", "hops", "link_seconds", "ring_bytes", "runs_flat"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DIMS = ("intra", "inter", "global")
GB = 1e9


def ring_bytes(kind: str, nbytes: float, k: int) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``k`` ranks on a buffer of ``nbytes`` (the
    all-gather's output, the reduction's input): S(k-1)/k, doubled for an all-reduce."""
    per_rank = nbytes * (k - 1) / k
    return 2 * per_rank if kind == "all_reduce" else per_rank


def runs_flat(nbytes: float, flat_below_bytes: float) -> bool:
    """Whether a global collective of ``nbytes`` (the whole message: all-gather output,
    reduction input) runs as one flat collective over all ranks instead of PaRO-CC's intra and
    inter phases. The one rule: ``paro_cc.ParoCC`` issues by it and ``paro_fsdp.ledger`` counts by
    it. Flat wins where a second phase's latency and its extra pass over the fast links cost more
    than the inter bytes it saves: small messages, or inter links about as fast as intra ones
    (``tools.bench.collectives`` measures the crossover on a cluster). 0: never flat."""
    return 0 < nbytes < flat_below_bytes


def hops(kind: str, k: int) -> int:
    """Ring steps of ``kind`` over ``k`` ranks: k - 1, or 2(k - 1) for an all-reduce."""
    return 2 * (k - 1) if kind == "all_reduce" else k - 1


@dataclass(frozen=True)
class Link:
    """One kind of link as seen by one GPU: ring bus bandwidth (GB/s, 1e9 bytes, per GPU while
    every GPU of the node uses the link at once) and latency per ring step (microseconds).
    ``per_kind`` overrides both per collective kind (``tools.calibrate`` measures each kind:
    e.g. gloo runs reduce-scatter as an all-reduce, so its effective bandwidth is lower)."""

    bandwidth_gbs: float
    latency_us: float
    per_kind: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def cost(self, kind: str) -> tuple[float, float]:
        """(bytes per second, seconds per ring step) for a collective of ``kind``."""
        bw, lat = self.per_kind.get(kind, (self.bandwidth_gbs, self.latency_us))
        return bw * GB, lat * 1e-6


def link_seconds(link: Link, kind: str, k: int, nbytes_ring: float, count: float = 1) -> float:
    """Seconds ``count`` collectives of ``kind`` over ``k`` ranks take on ``link``, sending
    ``nbytes_ring`` ring bytes in all (:func:`ring_bytes`): count x steps x latency + bytes /
    bandwidth."""
    bw, lat = link.cost(kind)
    return count * hops(kind, k) * lat + nbytes_ring / bw


class CollectiveCounts:
    """Count and ring bytes of collectives per (kind, mesh dimension), per rank.

    The one counter type: the engine's ``comm.CommStats`` (what ran) and the spec's
    ``ledger.Traffic`` (what the method says runs) are both this, so comparing them is comparing
    ``as_dict()``. kind: all_gather / reduce_scatter / all_reduce; dim: intra / inter / global."""

    #: the count's type (the engine counts calls; the ledger may scale counts by any factor)
    count_type: type = int
    _count_format = ">6"

    def __init__(self) -> None:
        self._count: dict[tuple[str, str], float] = defaultdict(self.count_type)
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
        return {f"{k}/{d}": {"count": self._count[(k, d)], "bytes": self._bytes[(k, d)]} for (k, d) in sorted(self._count)}

    def __iadd__(self, other: "CollectiveCounts") -> "CollectiveCounts":
        for key, v in other._count.items():
            self._count[key] += v
        for key, v in other._bytes.items():
            self._bytes[key] += v
        return self

    def __repr__(self) -> str:
        rows = [f"{k:>14} {d:>6} {self._count[(k, d)]:{self._count_format}} {self._bytes[(k, d)] / 2**20:12.3f} MiB"
                for (k, d) in sorted(self._count)]
        return f"{type(self).__name__}(\n" + "\n".join(rows) + "\n)"
