"""What one collective is: its kinds and mesh dimensions, the bytes one rank sends in its ring,
its ring steps, whether a global one runs flat, and ``CommStats``, the one counter of collectives.

Why one module under everything else: the engine counts what it issues (``comm.MeshComm``), the
ledger counts what the method says it issues (``cost.ledger``), the graph passes price the
collectives of a compiled graph (``passes``) and the cost model times them (``cost.predict``); all
must use the same formula, and the engine's counter and the ledger's must compare as equals.

Ring cost per rank of a collective over k ranks on a buffer of S bytes (the full, gathered size):
all-gather and reduce-scatter send S(k-1)/k in k-1 ring steps, all-reduce 2S(k-1)/k in 2(k-1).
This is the *logical* cost: gloo runs reduce-scatter as an all-reduce, so its wire bytes are
higher. No torch here: the advisor is arithmetic.
"""
from __future__ import annotations

from collections import defaultdict

__all__ = ["DIMS", "KINDS", "CommStats", "hops", "ring_bytes", "runs_flat"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DIMS = ("intra", "inter", "global")


def ring_bytes(kind: str, nbytes: float, k: int) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``k`` ranks on a buffer of ``nbytes`` (the
    all-gather's output, the reduction's input): S(k-1)/k, doubled for an all-reduce."""
    per_rank = nbytes * (k - 1) / k
    return 2 * per_rank if kind == "all_reduce" else per_rank


def hops(kind: str, k: int) -> int:
    """Ring steps of ``kind`` over ``k`` ranks: k - 1, or 2(k - 1) for an all-reduce."""
    return 2 * (k - 1) if kind == "all_reduce" else k - 1


def runs_flat(nbytes: float, flat_below_bytes: float) -> bool:
    """Whether a global collective of ``nbytes`` (the whole message: all-gather output,
    reduction input) runs as one flat collective over all ranks instead of PaRO-CC's intra and
    inter phases. The one rule: ``paro_cc.ParoCC`` issues by it and ``cost.ledger`` counts by it.
    Flat wins where a second phase's latency and its extra pass over the fast links cost more
    than the inter bytes it saves: small messages, or inter links about as fast as intra ones
    (``tools.bench.collectives`` measures the crossover on a cluster). 0: never flat."""
    return 0 < nbytes < flat_below_bytes


class CommStats:
    """Count and ring bytes of collectives per (kind, mesh dimension), per rank.

    ``model.comm_stats()`` is one (what ran) and ``cost.ledger.traffic_of`` returns one (what the
    method says runs), so comparing them is comparing ``as_dict()``. kind: all_gather /
    reduce_scatter / all_reduce; dim: intra / inter / global. The engine counts calls (ints); the
    ledger scales a bucket's collectives by the micro-step count, which may make counts floats."""

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
        return {f"{k}/{d}": {"count": self._count[(k, d)], "bytes": self._bytes[(k, d)]} for (k, d) in sorted(self._count)}

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
