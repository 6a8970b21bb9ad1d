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

A quantized inter wire (``plan_of(s, inter_dtype)``) marks every move that crosses groups (inter,
and a global one's inter phase): the parameters' (gather, push) in int8, the gradients' (reduce,
boundary) in ``inter_dtype``, as ZeRO++ sends int8 weights and int4 gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Optional

from .collectives import Dim, Kind, check_wire
from .strategy import Level, Strategy, StrategyLike

__all__ = ["PHASES", "Move", "Plan", "plan_of"]

PHASES = ("gather", "reduce", "boundary", "push")
_N, _I, _G = Level.N, Level.I, Level.G
_INTRA, _INTER, _GLOBAL = Dim.INTRA, Dim.INTER, Dim.GLOBAL


@dataclass(frozen=True)
class Move:
    """One collective of a phase. A new kind of collective, or one that travels in another dtype,
    is a new entry in the tables below (``kind``, ``wire``) plus the ``MeshComm`` / ``ParoCC``
    method that implements it; the engine, the ledger and the passes read them from here."""

    kind: Kind
    dim: Dim
    src: Level
    dst: Level
    #: the dtype on the wire (a torch-free name, e.g. "int8"); None: the working dtype
    wire: Optional[str] = None

    @property
    def dims(self) -> frozenset[Dim]:
        """The process groups it runs on: a global one uses all three (its phases, or flat)."""
        return frozenset(Dim) if self.dim == _GLOBAL else frozenset((self.dim,))

    def numel(self, psi: float, m: int) -> float:
        """Elements of its buffer for a bucket of ``psi`` (the all-gather's output, the
        reduction's input): an inter move runs on an I-level buffer, 1/m of the tensors."""
        return psi / m if self.dim == _INTER else psi


_ag, _rs, _ar = (partial(Move, kind) for kind in (Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.ALL_REDUCE))
#: whole tensors from the P-level shard (the micro-step's gather)
_GATHER = {_N: (), _I: (_ag(_INTRA, _I, _N),), _G: (_ag(_GLOBAL, _G, _N),)}
#: whole gradients to the G level (the micro-step's reduction)
_REDUCE = {_N: (), _I: (_rs(_INTRA, _N, _I),), _G: (_rs(_GLOBAL, _N, _G),)}
#: (G, OS): the accumulated gradient, fully reduced, at the OS level
_BOUNDARY = {
    (_N, _N): (_ar(_GLOBAL, _N, _N),),
    (_N, _I): (_rs(_INTRA, _N, _I), _ar(_INTER, _I, _I)),
    (_N, _G): (_rs(_GLOBAL, _N, _G),),
    (_I, _N): (_ar(_INTER, _I, _I), _ag(_INTRA, _I, _N)),
    (_I, _I): (_ar(_INTER, _I, _I),),
    (_I, _G): (_rs(_INTER, _I, _G),),
    (_G, _N): (_ag(_GLOBAL, _G, _N),),
    (_G, _I): (_ag(_INTER, _G, _I),),
    (_G, _G): (),
}
#: (OS, P): the updated masters at the P level (coarser P: gathered; finer or equal: local)
_PUSH = {
    (_I, _N): (_ag(_INTRA, _I, _N),),
    (_G, _N): (_ag(_GLOBAL, _G, _N),),
    (_G, _I): (_ag(_INTER, _G, _I),),
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

    def dims(self, phase: str) -> frozenset[Dim]:
        """The process groups a phase runs on (empty: local work only)."""
        return frozenset().union(*(m.dims for m in self.phase(phase)))

    def runs_global(self, phase: str) -> bool:
        """Whether a phase has a global move: one PaRO-CC call, on a NESTED buffer."""
        return any(m.dim == _GLOBAL for m in self.phase(phase))

    # ---- what the levels decide about buffers and storage: the engine and the ledger ask here
    @property
    def params_whole(self) -> bool:
        """P = N: every rank keeps whole working tensors; nothing to gather, nothing to free."""
        return self.strategy.p == _N

    @property
    def grads_whole(self) -> bool:
        """G = N: each micro-step's gradients are added locally into a whole-size accumulator."""
        return self.strategy.g == _N

    @property
    def masters_whole(self) -> bool:
        """OS = N: every rank updates whole fp32 masters (the push is a local slice)."""
        return self.strategy.os == _N

    @property
    def p_at_os(self) -> bool:
        """P and OS at one level: the P storage can be the masters themselves (shared in fp32,
        sent cast by each gather in a lower dtype), no copy beside them."""
        return self.strategy.p == self.strategy.os

    @property
    def p_shard_at_os(self) -> bool:
        """P sharded, at the OS level: in a lower param dtype a gather can send the fp32 masters
        cast (FSDP2's copy-in), so no P copy is kept beside them."""
        return self.p_at_os and not self.params_whole

    @property
    def push_reaches_p(self) -> bool:
        """The push's collectives leave the masters at the P level itself (else P is finer: a
        local slice of their result)."""
        return (self.push[-1].dst if self.push else self.strategy.os) == self.strategy.p


#: the phases that move parameters (int8 whenever the inter wire is quantized); the rest move gradients
_PARAM_PHASES = ("gather", "push")


def plan_of(strategy: StrategyLike, inter_dtype: Optional[str] = None) -> Plan:
    """The strategy's plan; ``inter_dtype`` ("int8", "int4"): what crosses groups, quantized."""
    s = Strategy.parse(strategy)
    phases = {"gather": _GATHER[s.p], "reduce": _REDUCE[s.g], "boundary": _BOUNDARY[(s.g, s.os)],
              "push": _PUSH.get((s.os, s.p), ())}
    if inter_dtype is not None:
        check_wire(inter_dtype)
        for name, moves in phases.items():
            wire = "int8" if name in _PARAM_PHASES else inter_dtype
            phases[name] = tuple(replace(m, wire=wire) if m.dim != _INTRA else m for m in moves)
    return Plan(s, **phases)
