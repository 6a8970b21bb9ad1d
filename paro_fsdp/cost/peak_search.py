"""The budget's whole peak over plans: the smallest any plan reaches, and the fastest plan within a budget.

Why: the knapsack (``knapsack.solve``) bounds the backward's moments exactly, but a step peaks at the
boundary (G = N's full-size gradients) or at the push (P = N's gathered parameters) too, whose additive
parts differ per strategy: a plan the knapsack called the smallest could peak above it, and a budget above
the smallest it named was refused (a ViT: every budget from 1.19 to 1.65 MiB). Here every plan is priced
by its whole peak (``ledger.peak_from``, the formula ``predict`` uses), so the smallest footprint a
refusal names is a plan's, and ``cost.budget`` accepts that plan at any budget at or above it.

How: options no other beats on every part of the peak and on time are kept (Pareto); every option of one
block is priced at once with the others fixed (numpy over the ledger's sums and largest terms). The
smallest: descents from many starts (the knapsack's smallest plan; each block's option of least weighted
moments, each largest term held under each of its values), each block moved to its option of least peak,
and, where no single move helps, every block that holds a largest term moved under it at once, level after
level. Checked against brute force on small models (``tests/test_auto_refusal.py``). The fastest plan within
a budget: from given starts, blocks moved to lower the peak at the least time per byte until it fits, then
to faster options while it fits; ``cost.budget`` takes the fastest of this and the knapsack's plan.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .knapsack import Option
from .ledger import SUMMED, TOPPED, peak_from

__all__ = ["PlanPeaks"]

_SWEEPS = 64
_EPS = 1e-3  # bytes: sums in another order differ by float noise, not by a move
_ACC_COLUMN = SUMMED.index("G")  # the one part the peak subtracts (the push holds master gradients, not G)
_WEIGHTS = ((1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1), (1, 1, 1))


class PlanPeaks:
    """The whole peak of plans (one option index per item) over ``items``, each option's ``detail`` its
    block's summed ``ledger.peak_terms``; the backward's activations as ``ledger.peak_of`` takes them."""

    def __init__(self, items: Sequence[Sequence[Option]], activations: float, checkpoint: bool, cap: float,
                 in_backward: Optional[float] = None, after_backward: Optional[float] = None) -> None:
        self.args = (activations, checkpoint, cap, in_backward, after_backward)
        shared: dict[int, tuple] = {}  # identical blocks share one option list: priced and pruned once
        for opts in items:
            if id(opts) not in shared:
                sums = np.array([[o.detail[k] for k in SUMMED] for o in opts], dtype=float).reshape(len(opts), -1)
                tops = np.array([[o.detail[k] for k in TOPPED] for o in opts], dtype=float).reshape(len(opts), -1)
                times = np.array([o.t for o in opts], dtype=float)
                sign = np.where(np.arange(len(SUMMED)) == _ACC_COLUMN, -1.0, 1.0)
                keys = np.hstack([sums * sign, tops, times[:, None]])
                keep = _pareto(keys)
                shared[id(opts)] = (keep, keys, (sums, tops, times), (sums[keep], tops[keep], times[keep]))
        self.keep, self.keys, full, pruned = (list(x) for x in zip(*(shared[id(o)] for o in items)))
        self.kind = [id(o) for o in items]  # items of one kind share their options
        self.full = full  # per item (sums, tops, times) of every option, in the original indices
        self.sums, self.tops, self.times = (list(x) for x in zip(*pruned))

    # ---- one plan, in the original option indices ----
    def peak(self, idx: Sequence[int]) -> float:
        sums = sum(self.full[k][0][i] for k, i in enumerate(idx))
        tops = np.max([self.full[k][1][i] for k, i in enumerate(idx)], axis=0)
        return float(self._peaks(sums[None], tops[None])[0][0])

    def time(self, idx: Sequence[int]) -> float:
        return float(sum(self.full[k][2][i] for k, i in enumerate(idx)))

    def smallest(self, starts: Sequence[Sequence[int]] = ()) -> tuple[float, list[int]]:
        """The smallest whole peak found and its plan (module docstring)."""
        seeds = {tuple(self._inner(s)): None for s in starts}
        parts = [_parts(s) for s in self.sums]
        for cap in self._caps():
            for seed in {tuple(int(np.argmin(p @ np.array(w, float) + np.where(_over(t, cap), np.inf, 0.0)))
                               for p, t in zip(parts, self.tops)) for w in _WEIGHTS}:
                seeds[tuple(self._descend(list(seed), cap))] = None
        plans = {tuple(self._descend(list(s))) for s in seeds}
        best = min(plans, key=lambda p: (self._state(p).score()[0], self._time(p)))
        return self._state(best).score()[0], self._outer(best)

    def fastest(self, limit: float, starts: Sequence[Sequence[int]]) -> Optional[list[int]]:
        """The fastest plan within ``limit`` found from ``starts`` (module docstring); None if none fits."""
        best: Optional[list[int]] = None
        for start in starts:
            idx = self._fit(self._inner(start), limit)
            if idx is not None:
                idx = self._speed_up(idx, limit)
                if best is None or self._time(idx) < self._time(best):
                    best = idx
        return None if best is None else self._outer(best)

    # ---- the search, in pruned indices ----
    def _inner(self, idx: Sequence[int]) -> list[int]:
        """A plan in pruned indices: each option, or a kept one at or under it in every part."""
        out = []
        for k, i in enumerate(idx):
            hit = np.flatnonzero(self.keep[k] == i)
            under = np.flatnonzero((self.keys[k][self.keep[k]] <= self.keys[k][i]).all(axis=1))
            out.append(int(hit[0]) if len(hit) else int(under[0]))
        return out

    def _outer(self, idx: Sequence[int]) -> list[int]:
        return [int(self.keep[k][i]) for k, i in enumerate(idx)]

    def _time(self, idx: Sequence[int]) -> float:
        return float(sum(self.times[k][i] for k, i in enumerate(idx)))

    def _peaks(self, sums: np.ndarray, tops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(peak, sum of the three moments) of each row of ``sums`` / ``tops``."""
        got = peak_from(dict(zip(SUMMED, sums.T)), dict(zip(TOPPED, tops.T)), *self.args)
        return got["peak"], got["backward"] + got["boundary"] + got["push"]

    def _state(self, idx: Sequence[int]) -> "_Plan":
        return _Plan(self, list(idx))

    def _best(self, k: int, peak: np.ndarray, total: np.ndarray, cap: Optional[np.ndarray]) -> int:
        if cap is not None:
            peak = np.where(_over(self.tops[k], cap), np.inf, peak)
        return int(np.lexsort((self.times[k], total, peak))[0])

    def _descend(self, idx: Sequence[int], cap: Optional[np.ndarray] = None) -> list[int]:
        """Each item moved to its option of least (peak, moments' sum, time), and every item holding a largest
        term moved under it at once (``_lower``), until neither improves the plan; ``cap``: options over it out."""
        plan = self._state(idx)
        for _ in range(_SWEEPS):
            moved = False
            for k in range(len(idx)):
                peak, total = plan.options(k)
                j = self._best(k, peak, total, cap)
                if _better((peak[j], total[j]), (peak[plan.idx[k]], total[plan.idx[k]])):
                    plan.set(k, j)
                    moved = True
            if not moved:
                lowered = self._lower(plan, cap)
                if lowered is None:
                    break
                plan = lowered
        return plan.idx

    def _lower(self, plan: "_Plan", cap: Optional[np.ndarray]) -> Optional["_Plan"]:
        """The plan with one largest term lowered, level after level, at the first level that improves it."""
        now = plan.score()
        for d in range(len(TOPPED)):
            new: Optional[_Plan] = plan.copy()
            while new is not None and new.ct[:, d].max() > 0:
                new = self._under(new, d, cap)
                if new is not None and _better(new.score(), now):
                    return new
        return None

    def _under(self, plan: "_Plan", d: int, cap: Optional[np.ndarray]) -> Optional["_Plan"]:
        """Every item holding largest term ``d`` moved, one after another, to its best option under it; None
        where one has none."""
        top = plan.ct[:, d].max()
        below = np.full(len(TOPPED), np.inf)
        below[d] = top - 2 * _EPS
        below = below if cap is None else np.minimum(cap, below)
        done: dict[tuple, int] = {}  # holders of one kind at one option move alike: priced once
        for k in (int(k) for k in np.flatnonzero(plan.ct[:, d] > top - _EPS)):
            key = (self.kind[k], plan.idx[k])
            if key not in done:
                peak, total = plan.options(k)
                done[key] = self._best(k, peak, total, below)
            j = done[key]
            if _over(self.tops[k][j][None], below)[0]:
                return None
            plan.set(k, j)
        return plan

    def _caps(self) -> list[np.ndarray]:
        """Caps on the largest terms: none, then each term held at or under each of its values (one at a time)."""
        inf = np.full(len(TOPPED), np.inf)
        caps = [inf]
        for d in range(len(TOPPED)):
            lowest = max(float(t[:, d].min()) for t in self.tops)  # no plan's term is under every item's least
            for v in sorted({float(x) for t in self.tops for x in t[:, d] if x >= lowest}):
                cap = inf.copy()
                cap[d] = v
                caps.append(cap)
        return caps

    def _fit(self, idx: list[int], limit: float) -> Optional[list[int]]:
        plan = self._state(idx)
        for _ in range(_SWEEPS * len(idx)):
            now = plan.score()[0]
            if now <= limit:
                return plan.idx
            best: Optional[tuple] = None
            for k in range(len(idx)):
                peak, _ = plan.options(k)
                gain = now - peak
                ok = np.flatnonzero(gain > _EPS)
                if len(ok):
                    rate = (self.times[k][ok] - self.times[k][plan.idx[k]]) / gain[ok]
                    j = int(ok[np.lexsort((-gain[ok], rate))[0]])
                    key = (rate[list(ok).index(j)], -gain[j], k, j)
                    best = key if best is None or key < best else best
            if best is None:
                return None
            plan.set(best[2], best[3])
        return None

    def _speed_up(self, idx: list[int], limit: float) -> list[int]:
        plan = self._state(idx)
        for _ in range(_SWEEPS):
            moved = False
            for k in range(len(idx)):
                peak, _ = plan.options(k)
                ok = np.flatnonzero(peak <= limit)
                if len(ok):
                    j = int(ok[np.argmin(self.times[k][ok])])
                    if self.times[k][j] < self.times[k][plan.idx[k]] - 1e-15:
                        plan.set(k, j)
                        moved = True
            if not moved:
                break
        return plan.idx


class _Plan:
    """A plan being searched: its options' sums and largest terms, row per item, updated as items move."""

    def __init__(self, peaks: PlanPeaks, idx: list[int]) -> None:
        self.p, self.idx = peaks, idx
        self.cs = np.array([peaks.sums[k][i] for k, i in enumerate(idx)]).reshape(len(idx), len(SUMMED))
        self.ct = np.array([peaks.tops[k][i] for k, i in enumerate(idx)]).reshape(len(idx), len(TOPPED))

    def copy(self) -> "_Plan":
        return _Plan(self.p, list(self.idx))

    def set(self, k: int, j: int) -> None:
        self.idx[k] = j
        self.cs[k], self.ct[k] = self.p.sums[k][j], self.p.tops[k][j]

    def score(self) -> tuple[float, float]:
        peak, total = self.p._peaks(self.cs.sum(axis=0)[None], self.ct.max(axis=0)[None])
        return float(peak[0]), float(total[0])

    def options(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(peak, moments' sum) of the plan with item ``k`` at each of its options, the others as they are."""
        rest = self.cs.sum(axis=0) - self.cs[k]
        others = np.delete(self.ct, k, axis=0)
        top = others.max(axis=0) if len(others) else np.zeros(len(TOPPED))
        return self.p._peaks(rest + self.p.sums[k], np.maximum(top, self.p.tops[k]))


def _pareto(keys: np.ndarray) -> np.ndarray:
    """Indices of the rows no other row is at or under in every column (the first of equal rows kept)."""
    keep = []
    for i, row in enumerate(keys):
        le = (keys <= row).all(axis=1)
        lt = (keys < row).any(axis=1)
        eq = ~lt & le
        if not (le & lt).any() and not eq[:i].any():
            keep.append(i)
    return np.array(keep, dtype=int)


def _parts(sums: np.ndarray) -> np.ndarray:
    """Per option: its additive part of the backward, boundary and push moments."""
    c = dict(zip(SUMMED, sums.T))
    return np.stack([c["states"] + c["kept"], c["states"] + c["boundary"] + c["queue"],
                     c["states"] - c["G"] + c["master_grads"] + c["push"]], axis=1)


def _over(tops: np.ndarray, cap: np.ndarray) -> np.ndarray:
    return (tops > cap + _EPS).any(axis=1)


def _better(a: tuple, b: tuple) -> bool:
    return a[0] < b[0] - _EPS or (a[0] <= b[0] + _EPS and a[1] < b[1] - _EPS)
