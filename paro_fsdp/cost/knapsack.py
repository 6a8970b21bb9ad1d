"""The budget's solver: one option per item, the fastest whose footprint fits, exactly.

Why ``solve`` enumerates: the peak's max terms (one block's gathered parameters, gradients) and
capped sums (overlap's queue) are not additive; the additive rest is a DP over memory with every
weight rounded *up* to the grid, so a plan it accepts fits for certain, and every plan with k grid
cells to spare (k items) is accepted. Arithmetic only: ``cost.budget`` builds the items.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .cluster import AdvisorError, GiB

__all__ = ["DEFAULT_CELLS", "BudgetError", "Footprint", "Option", "min_footprint", "solve", "within"]

DEFAULT_CELLS = 1 << 14


class BudgetError(AdvisorError):
    """Nothing fits the budget: one line, naming the smallest footprint and what gives it (``smallest``:
    its bytes, a plan accepted at any budget at or above them; None where no plan was priced)."""

    def __init__(self, message: str, smallest: Optional[float] = None) -> None:
        super().__init__(message)
        self.smallest = smallest


def _size(x: float) -> str:
    return f"{x / GiB:.3f} GiB" if x >= GiB else f"{x / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Option:
    """One choice for one item. ``w``: additive bytes; ``t``: seconds; ``peaks[d]``: its value of
    max term d; ``queues[j]``: what it adds to capped sum j; ``label``: what it stands for."""

    w: float
    t: float
    peaks: tuple[float, ...] = ()
    queues: tuple[float, ...] = ()
    label: Any = None
    detail: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Footprint:
    """footprint(plan) = sum w + max over moments (const + sum_d coefs[d] x max_items peaks[d])
    + sum_j min(caps[j], sum_items queues[j]); the moments: (const, coefs), then each of ``also``
    (the backward's moments: ``ledger.backward_moments``)."""

    const: float = 0.0
    coefs: tuple[float, ...] = ()
    caps: tuple[float, ...] = ()
    also: tuple[tuple[float, tuple[float, ...]], ...] = ()

    def fixed(self, T: Sequence[float]) -> float:
        """The largest moment's constant part, each max term at its value in ``T``."""
        return max(c + sum(k * t for k, t in zip(coefs, T)) for c, coefs in ((self.const, self.coefs), *self.also))

    def of(self, chosen: Sequence[Option]) -> float:
        T = [max((o.peaks[d] for o in chosen), default=0.0) for d in range(len(self.coefs))]
        total = self.fixed(T) + sum(o.w for o in chosen)
        for j, cap in enumerate(self.caps):
            total += min(cap, sum(o.queues[j] for o in chosen))
        return total


def _pareto(opts: Sequence[Option]) -> list[int]:
    """Indices of the options no other beats or ties on every dimension (the first of equals kept)."""
    keys = [(o.w, o.t, *o.peaks, *o.queues) for o in opts]
    keep = []
    for i, a in enumerate(keys):
        if not any(j != i and all(x <= y for x, y in zip(b, a)) and (b != a or j < i) for j, b in enumerate(keys)):
            keep.append(i)
    return keep


def _cases(items: Sequence[Sequence[Option]], fp: Footprint):
    """(thresholds per max term, branch per cap: True = the cap) worth solving."""
    thresholds = []
    for d in range(len(fp.coefs)):
        low = max((min(o.peaks[d] for o in opts) for opts in items), default=0.0)
        thresholds.append(sorted({o.peaks[d] for opts in items for o in opts if o.peaks[d] >= low}) or [0.0])
    branches = []
    for j, cap in enumerate(fp.caps):
        most = sum(max(o.queues[j] for o in opts) for opts in items)
        least = sum(min(o.queues[j] for o in opts) for opts in items)
        branches.append([False] if most <= cap else [True] if least >= cap else [False, True])
    return itertools.product(itertools.product(*thresholds), itertools.product(*branches))


def _case(items, fp: Footprint, T, capped):
    """Options allowed under thresholds ``T`` (indices), their case weights, and the room's constant."""
    allowed, weights = [], []
    for opts in items:
        idx = [i for i, o in enumerate(opts) if all(o.peaks[d] <= T[d] for d in range(len(T)))]
        allowed.append(idx)
        weights.append([opts[i].w + sum(opts[i].queues[j] for j in range(len(capped)) if not capped[j]) for i in idx])
    fixed = fp.fixed(T) + sum(cap for cap, c in zip(fp.caps, capped) if c)
    return allowed, weights, fixed


def _knapsack(weights: list[list[float]], times: list[list[float]], room: float, cells: int) -> Optional[list[int]]:
    """Min total time with total weight <= room, one option per item (positions into each list), by
    DP over memory rounded up to a grid (module docstring); None when nothing fits."""
    import numpy as np

    integral = all(abs(w - round(w)) < 1e-9 for ws in weights for w in ws)
    if integral and room <= cells:
        delta, C = 1.0, int(math.floor(room + 1e-9))
    else:
        delta, C = room / cells, cells
    cw = [[int(math.ceil(w / delta - 1e-9)) for w in ws] for ws in weights]
    dp = np.full(C + 1, np.inf)
    dp[0] = 0.0
    arg = np.full((len(weights), C + 1), -1, dtype=np.int32)
    for i, (ws, ts) in enumerate(zip(cw, times)):
        new = np.full(C + 1, np.inf)
        for j, (w, t) in enumerate(zip(ws, ts)):
            if w > C:
                continue
            cand = np.full(C + 1, np.inf)
            cand[w:] = dp[: C + 1 - w] + t
            better = cand < new
            new[better] = cand[better]
            arg[i][better] = j
        dp = new
    if not np.isfinite(dp).any():
        return None
    c = int(np.argmin(dp))  # the first of equal times: the least memory
    out = []
    for i in range(len(weights) - 1, -1, -1):
        j = int(arg[i][c])
        out.append(j)
        c -= cw[i][j]
    return out[::-1]


def solve(items: Sequence[Sequence[Option]], budget: float, fp: Footprint = Footprint(),
          cells: int = DEFAULT_CELLS) -> Optional[tuple[list[int], float, float]]:
    """The fastest plan (one option index per item) whose footprint is within ``budget``:
    (indices, footprint, time), or None when nothing fits. Exact up to the grid (module docstring)."""
    pruned = [_pareto(opts) for opts in items]
    sub = [[opts[i] for i in keep] for opts, keep in zip(items, pruned)]
    best: Optional[tuple[float, float, list[int]]] = None
    for T, capped in _cases(sub, fp):
        allowed, weights, fixed = _case(sub, fp, T, capped)
        room = budget - fixed
        if room < 0 or any(not a for a in allowed):
            continue
        times = [[sub[k][i].t for i in a] for k, a in enumerate(allowed)]
        pick = _knapsack(weights, times, room, cells)
        if pick is None:
            continue
        chosen = [allowed[k][j] for k, j in enumerate(pick)]
        plan = [sub[k][i] for k, i in enumerate(chosen)]
        key = (sum(o.t for o in plan), fp.of(plan), [pruned[k][i] for k, i in enumerate(chosen)])
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    return best[2], best[1], best[0]


def min_footprint(items: Sequence[Sequence[Option]], fp: Footprint = Footprint()) -> tuple[float, list[int]]:
    """The smallest footprint any plan has, and a plan with it (exact: the same cases as ``solve``,
    each item then takes its lightest allowed option)."""
    best: Optional[tuple[float, list[int]]] = None
    for T, capped in _cases(items, fp):
        allowed, weights, fixed = _case(items, fp, T, capped)
        if any(not a for a in allowed):
            continue
        chosen = [a[min(range(len(ws)), key=lambda i: (ws[i], items[k][a[i]].t))]
                  for k, (a, ws) in enumerate(zip(allowed, weights))]
        value = fp.of([items[k][i] for k, i in enumerate(chosen)])
        if best is None or value < best[0]:
            best = (value, chosen)
    if best is None:
        raise ValueError("min_footprint: an item has no options")
    return best


def within(items, fp: Footprint, limit: float, cells: int, peak_of_plan: Callable[[list[int]], float]):
    """``solve``'s fastest plan whose whole peak (``peak_of_plan``) is within ``limit``: the knapsack
    bounds the backward's moments (``fp``), and where the boundary's or the push's moment of its plan
    is over, the largest room whose plan fits, by bisection down to the smallest footprint."""
    fits = lambda room: (lambda f: f if f is not None and peak_of_plan(f[0]) <= limit else None)(  # noqa: E731
        solve(items, room, fp, cells))
    found = fits(limit)
    lo, hi = min_footprint(items, fp)[0], limit
    for _ in range(0 if found is not None or lo > hi else 12):
        mid = (lo + hi) / 2
        better = fits(mid)
        lo, hi, found = (mid, hi, better) if better is not None else (lo, mid, found)
    return found
