"""The plan: which collectives each strategy runs in a step, written once.

Why one table: the engine executes it (``param_group`` per micro-step, ``boundary`` at the step
boundary and the push), the ledger counts it (``cost.ledger``) and the overlap reads its process
groups from it (``overlap``). Written three times, one copy could change and the others silently
disagree; ``tests/test_plan.py`` checks the collectives the engine records against this table for
all 27 strategies.

A step has four phases; each is an ordered tuple of ``Move``s:

  gather    each time a block's parameters are gathered (forward; again in backward after it was
            freed): the P-level shard -> whole tensors
  reduce    each micro-step's whole-tensor gradients -> the G level (G = N: added locally)
  boundary  once per step: the accumulated G-level gradient -> the OS level, summed over all ranks
  push      once per step, after the update: the fp32 OS-level masters -> the P level in param dtype

A move reads a buffer at ``src`` and leaves one at ``dst``. "global" is one PaRO-CC call over all
ranks (hierarchical phases, or flat below ``flat_below_bytes``). An "inter" move runs on an I-level
buffer (1/m of the tensors). ``I -> I`` is the inter all-reduce of a gradient already reduced
inside the group. Levels finer than the last move's result are local slices, not collectives
(push: P = G from OS = I; OS = N to any P).
"""
from __future__ import annotations

from dataclasses import dataclass

from .strategy import Level, Strategy, StrategyLike

__all__ = ["PHASES", "Move", "Plan", "plan_of"]

PHASES = ("gather", "reduce", "boundary", "push")
_N, _I, _G = Level.N, Level.I, Level.G


@dataclass(frozen=True)
class Move:
    """One collective of a phase."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce"
    dim: str  # "intra", "inter" or "global"
    src: Level
    dst: Level

    @property
    def dims(self) -> frozenset[str]:
        """The process groups it runs on: a global one uses all three (its phases, or flat)."""
        return frozenset(("inter", "intra", "global")) if self.dim == "global" else frozenset((self.dim,))

    def numel(self, psi: float, m: int) -> float:
        """Elements of its buffer for a bucket of ``psi`` (the all-gather's output, the
        reduction's input): an inter move runs on an I-level buffer, 1/m of the tensors."""
        return psi / m if self.dim == "inter" else psi


def _ag(dim: str, src: Level, dst: Level) -> Move:
    return Move("all_gather", dim, src, dst)


def _rs(dim: str, src: Level, dst: Level) -> Move:
    return Move("reduce_scatter", dim, src, dst)


def _ar(dim: str, src: Level, dst: Level) -> Move:
    return Move("all_reduce", dim, src, dst)


#: whole tensors from the P-level shard (the micro-step's gather)
_GATHER = {_N: (), _I: (_ag("intra", _I, _N),), _G: (_ag("global", _G, _N),)}
#: whole gradients to the G level (the micro-step's reduction)
_REDUCE = {_N: (), _I: (_rs("intra", _N, _I),), _G: (_rs("global", _N, _G),)}
#: (G, OS): the accumulated gradient, fully reduced, at the OS level
_BOUNDARY = {
    (_N, _N): (_ar("global", _N, _N),),
    (_N, _I): (_rs("intra", _N, _I), _ar("inter", _I, _I)),
    (_N, _G): (_rs("global", _N, _G),),
    (_I, _N): (_ar("inter", _I, _I), _ag("intra", _I, _N)),
    (_I, _I): (_ar("inter", _I, _I),),
    (_I, _G): (_rs("inter", _I, _G),),
    (_G, _N): (_ag("global", _G, _N),),
    (_G, _I): (_ag("inter", _G, _I),),
    (_G, _G): (),
}
#: (OS, P): the updated masters at the P level (coarser P: gathered; finer or equal: local)
_PUSH = {
    (_I, _N): (_ag("intra", _I, _N),),
    (_G, _N): (_ag("global", _G, _N),),
    (_G, _I): (_ag("inter", _G, _I),),
}


@dataclass(frozen=True)
class Plan:
    """One strategy's collectives, phase by phase."""

    strategy: Strategy
    gather: tuple[Move, ...]
    reduce: tuple[Move, ...]
    boundary: tuple[Move, ...]
    push: tuple[Move, ...]

    def phase(self, name: str) -> tuple[Move, ...]:
        return getattr(self, name)

    def dims(self, phase: str) -> frozenset[str]:
        """The process groups a phase runs on (empty: local work only)."""
        return frozenset().union(*(m.dims for m in self.phase(phase)))


def plan_of(strategy: StrategyLike) -> Plan:
    """The strategy's plan."""
    s = Strategy.parse(strategy)
    return Plan(s, _GATHER[s.p], _REDUCE[s.g], _BOUNDARY[(s.g, s.os)], _PUSH.get((s.os, s.p), ()))
