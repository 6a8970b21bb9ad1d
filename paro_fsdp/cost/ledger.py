"""The method's ledger and memory formula as code, exact for this engine.

Why: arithmetic on parameter counts only, so what the engine *counts* (``model.comm_stats()``,
``memory_report``) is checked against what the method *says* it costs, on real ranks and on a fake
64-rank world (``tools/estimate.py``).

Notation: n ranks, m per group, g = n / m groups; Psi = all parameters, Psi' = trainable ones;
``param_bytes`` / ``grad_bytes`` = element size of P / of G and their collectives; ``os_bytes`` per
trainable element of OS (AdamW: 12 = K). The collectives are the plan's: per micro-step ``gather``
(twice for a block, once for the root) and ``reduce``; once per step ``boundary`` and ``push``, on
Psi'. A global one counts as PaRO-CC's phases (``collectives.HIER``), or flat below
``flat_below_bytes``, sized by the bucket's Psi (the engine: its padded buffer); a quantized inter
move as ``collectives.QUANTIZED`` on its ``wire_bytes``; the clip as one flat fp32 all-reduce.

Memory per rank: M = param_bytes Psi/d(P) + grad_bytes Psi'/d(G) + os_bytes Psi'/d(OS), d(N) = 1,
d(I) = m, d(G) = n; where fp32 P and OS share a level the parameter is the master, so OS holds the
optimizer's states only (os_bytes - 4). Exact when n divides dim 0 of every tensor (else padding).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ..collectives import HIER, QUANTIZED, USED, CommStats, Dim, Kind, ring_bytes, runs_flat, wire_bytes
from ..plan import Move, plan_of
from ..strategy import Level, Strategy, StrategyLike

__all__ = ["Bucket", "Ledger", "backward_moments", "buckets_of", "formula_bytes", "formula_memory", "memory_of",
           "peak_from", "peak_of", "peak_terms", "traffic_of"]

_N = Level.N


class Ledger:
    """The method's collectives for one rank of an (n, m) mesh, counted into ``stats``, a
    ``CommStats`` like the engine's (counts scale by the micro-step count: they may be floats)."""

    def __init__(self, n: int, m: int, flat_below_bytes: int = 0) -> None:
        if n % m:
            raise ValueError(f"world size n={n} is not divisible by the group size m={m}")
        self.n, self.m, self.g = n, m, n // m
        self.flat_below_bytes = flat_below_bytes
        self.stats = CommStats()

    def add(self, kind: str, dim: str, full_numel: float, itemsize: int, times: float = 1,
            wire: Optional[str] = None) -> None:
        """Record ``times`` collectives of ``kind`` over ``dim`` on ``full_numel`` elements (an all-gather's
        output, a reduction's input); ``wire``: an inter one quantized, k pieces of codes and scales."""
        k = {Dim.INTRA: self.m, Dim.INTER: self.g, Dim.GLOBAL: self.n}[dim]
        if k == 1 or times == 0:
            return
        if wire is not None and dim == Dim.INTER:
            for q in QUANTIZED[Kind(kind)]:
                self.stats.record(q, dim, times * ring_bytes(q, k * wire_bytes(wire, full_numel / k), k), times)
            return
        self.stats.record(kind, dim, times * ring_bytes(kind, full_numel * itemsize, k), times)

    def count(self, moves: Iterable[Move], psi: float, itemsize: int, times: float = 1) -> None:
        """Record ``times`` runs of a plan phase on ``psi`` elements; a global move is one PaRO-CC call: its
        phases, or one flat collective (below the threshold, or on a mesh of one dimension)."""
        for move in moves:
            if move.dim != Dim.GLOBAL:
                self.add(move.kind, move.dim, move.numel(psi, self.m), itemsize, times, move.wire)
            elif self.m == 1 or self.g == 1 or runs_flat(psi * itemsize, self.flat_below_bytes):
                dim = Dim.GLOBAL if self.m > 1 and self.g > 1 else (Dim.INTER if self.m == 1 else Dim.INTRA)
                self.add(move.kind, dim, psi, itemsize, times, move.wire)
            else:
                for kind, dim in HIER[move.kind]:
                    self.add(kind, dim, psi / self.m if dim == Dim.INTER else psi, itemsize, times, move.wire)


@dataclass(frozen=True)
class Bucket:
    """Parameters that move together under one strategy (one ``ParoParamGroup``). ``gathers`` per
    micro-step: 2 for a block, 1 for the root or with ``reshard_after_forward=False``, 0 when P = N."""

    strategy: Strategy
    numel: int  # Psi of the bucket
    trainable: int  # Psi' of the bucket
    gathers: int = 2
    tensors: int = 0  # trainable tensors the end of backward asks about (ParoState.used_grads); 0: not counted


def traffic_of(buckets: Iterable[Bucket], n: int, m: int, grad_accum: int = 1, param_bytes: int = 2,
               grad_bytes: int = 2, clip: bool = False, flat_below_bytes: int = 0,
               inter_dtype: Optional[str] = None) -> CommStats:
    """Collectives per rank for one optimizer step of ``grad_accum`` micro-steps (and ``clip_grad_norm_`` if
    ``clip``), bucket by bucket, so counts and bytes match ``model.comm_stats()`` given ``buckets_of(model)``
    and the model's ``flat_below_bytes`` (``model._paro_state.cc``) and ``inter_dtype``."""
    t, buckets = Ledger(n, m, flat_below_bytes), list(buckets)
    for b in buckets:
        plan = plan_of(b.strategy, inter_dtype)
        t.count(plan.gather, b.numel, param_bytes, times=grad_accum * b.gathers)
        if b.trainable:  # a frozen bucket gets no gradient: nothing to reduce, nothing at the boundary
            t.count(plan.reduce, b.trainable, grad_bytes, times=grad_accum)
            t.count(plan.boundary, b.trainable, grad_bytes)
            t.count(plan.push, b.trainable, param_bytes)
    flags = sum(b.tensors for b in buckets if b.trainable)
    if flags:  # which tensors some rank used: a byte each, once a step (ParoState.used_grads)
        t.add(*USED, flags, 1)
    if clip:
        t.add(Kind.ALL_REDUCE, Dim.GLOBAL, 1, 4)  # the fp32 squared-norm scalar
    return t.stats


def memory_of(buckets: Iterable[Bucket], n: int, m: int, param_bytes: int = 2, grad_bytes: int = 2,
              os_bytes: int = 12) -> dict[str, float]:
    """Per-rank bytes of P, G, OS, their total and the fp32 master gradients (``memory_report`` keys;
    ``grad_bytes``: the accumulator's dtype)."""
    out = {"P": 0.0, "G": 0.0, "OS": 0.0, "master_grads": 0.0}
    for b in buckets:
        s = b.strategy
        cast = plan_of(s).p_shard_at_os and param_bytes != 4 and b.numel == b.trainable  # P is the master, sent cast
        out["P"] += 0.0 if cast else param_bytes * b.numel / s.p.divisor(n, m)
        out["G"] += grad_bytes * b.trainable / s.g.divisor(n, m)
        shared = 4 if s.p == s.os and param_bytes == 4 else 0  # fp32 P = OS: the parameter is the master
        out["OS"] += (os_bytes - shared) * b.trainable / s.os.divisor(n, m)
        out["master_grads"] += 4 * b.trainable / s.os.divisor(n, m)
    out["total"] = out["P"] + out["G"] + out["OS"]
    return out


def peak_terms(b: Bucket, n: int, m: int, param_bytes: int, grad_bytes: int, acc_bytes: int, kept: bool,
               root: bool = False) -> dict:
    """One bucket's parts of the per-rank peak (``peak_of``); ``kept``: gathered from forward to backward;
    ``root``: the root's bucket, whose gradient's reduction buffer is there at the peak too."""
    s, tr = b.strategy, b.trainable
    mem = memory_of([b], n, m, param_bytes, acc_bytes)
    gathered = param_bytes * b.numel if s.p != _N else 0.0
    reducing = grad_bytes * tr if s.g != _N and tr else 0.0
    return {"states": mem["total"], "G": mem["G"], "master_grads": mem["master_grads"],
            "kept": gathered if kept else 0.0,  # a P = G block's prefetch is in flight as PaRO-CC's 1/m chunks:
            "gathered": 0.0 if kept else gathered / (2 if s.p == Level.G else 1),  # half a block, measured
            "reducing": 0.0 if root else reducing,
            "nested": reducing if s.g == Level.G and not root else 0.0,
            "reduced": reducing / s.g.divisor(n, m) if not root else 0.0,  # the previous block's, in flight
            "root_grads": reducing if root else 0.0,  # the head's, held until the root's reduction at the end
            "queue": grad_bytes * tr / s.g.divisor(n, m) if tr and n > 1 else 0.0,
            "boundary": grad_bytes * tr if s.g == _N and s.os != Level.I and tr and n > 1 else 0.0,
            "push": param_bytes * tr if s.p == _N and s.os != _N else 0.0}


#: the max terms of the backward's moments (``peak_terms`` keys): a block's gathered parameters,
#: its whole gradients, PaRO-CC's NESTED copy of them, their reduced shard; the root's whole gradients
PEAK_MAX = ("gathered", "reducing", "nested", "reduced", "root_grads")


def backward_moments(activations: float, checkpoint: bool, in_backward: Optional[float] = None,
                     after_backward: Optional[float] = None) -> tuple[tuple[float, tuple[float, ...]], ...]:
    """The backward's moments, each (the activations held then, the multiples of ``PEAK_MAX``'s max terms),
    measured on CPU ranks (``tools.bench.memory_peak``, ``tools.bench.auto_budget``). Without checkpointing:
    at the loss (``activations``, no block gathered); inside a block's backward (``in_backward``: it
    re-gathered, the next prefetched); a block's backward done (``after_backward``: both blocks, its whole
    gradients, their reduction's input and gloo's copy of it, the NESTED copy, the previous reduction in
    flight, the head's whole gradients), where a model with parameters about its activations' size peaks.
    With checkpointing: mid-backward, the recomputed block's gather in flight too. None: ``activations``."""
    inside = activations if in_backward is None else in_backward
    after = (activations if after_backward is None else after_backward, (2.0, 3.0, 1.0, 1.0, 1.0))
    if checkpoint:
        return (activations, (3.0, 3.0, 1.0, 0.0, 0.0)), after
    return (activations, (0.0, 0.0, 0.0, 0.0, 0.0)), (inside, (2.0, 0.0, 0.0, 0.0, 0.0)), after


#: what the peak sums over the buckets, and what it takes the largest of (``peak_from``)
SUMMED = ("states", "queue", "kept", "boundary", "G", "master_grads", "push")
TOPPED = (*PEAK_MAX, "boundary")


def peak_of(terms: list[dict], activations: float, checkpoint: bool, cap: float, in_backward: Optional[float] = None,
            after_backward: Optional[float] = None) -> dict[str, float]:
    """A step's predicted per-rank peak from its buckets' ``peak_terms``: ``peak_from`` of their sums and
    largest terms."""
    sums = {k: sum(t[k] for t in terms) for k in SUMMED}
    tops = {k: max((t[k] for t in terms), default=0.0) for k in TOPPED}
    return {k: float(v) for k, v in peak_from(sums, tops, activations, checkpoint, cap, in_backward,
                                              after_backward).items()}


def peak_from(sums: dict, tops: dict, activations: float, checkpoint: bool, cap: float,
              in_backward: Optional[float] = None, after_backward: Optional[float] = None) -> dict:
    """The peak from the buckets' sums (``SUMMED``) and largest terms (``TOPPED``), the max of three moments:
    ``backward`` (states, the root's gathered parameters, the largest of ``backward_moments``; with
    checkpointing the boundary reductions in flight, within ``cap``), ``boundary`` (G = N's full-size
    reduction input, gloo's copy of the largest, overlap's queue) and ``push`` (master gradients, P = N's
    gathered push). Elementwise on arrays (``cost.peak_search`` prices every option of a block at once)."""
    import numpy as np

    queue = np.minimum(cap, sums["queue"])
    moments = backward_moments(activations, checkpoint, in_backward, after_backward)
    held = [a + sum(c * tops[k] for c, k in zip(coefs, PEAK_MAX)) for a, coefs in moments]
    backward = sums["states"] + sums["kept"] + functools.reduce(np.maximum, held)
    if checkpoint:
        backward = backward + queue  # the boundary's reductions in flight mid-backward
    boundary = sums["states"] + sums["boundary"] + tops["boundary"] + tops["reducing"] + queue
    push = sums["states"] - sums["G"] + sums["master_grads"] + sums["push"]
    return {"backward": backward, "boundary": boundary, "push": push,
            "peak": np.maximum(np.maximum(backward, boundary), push)}


def _whole_model(strategy: StrategyLike, psi: int, psi_trainable: int, psi_kept: int) -> list[Bucket]:
    """``psi_kept`` gathered once per micro-step (the root's, frozen here), the rest twice."""
    s = Strategy.parse(strategy)
    if not 0 <= psi_kept <= psi or not 0 <= psi_trainable <= psi:
        raise ValueError(f"need 0 <= psi_kept, psi_trainable <= psi, got {psi_kept}, {psi_trainable}, {psi}")
    once = 0 if plan_of(s).params_whole else 1
    return [Bucket(s, psi_kept, 0, once), Bucket(s, psi - psi_kept, psi_trainable, 2 * once)]


def formula_bytes(strategy: StrategyLike, psi: int, psi_trainable: int, n: int, m: int, grad_accum: int = 1,
                  psi_kept: int = 0, param_bytes: int = 2, grad_bytes: int = 2, clip: bool = False) -> dict[str, float]:
    """Per-rank bytes per step of a whole model under one strategy: ``{"intra", "inter", "global", "total"}``."""
    buckets = _whole_model(strategy, psi, psi_trainable, psi_kept)
    t = traffic_of(buckets, n, m, grad_accum, param_bytes, grad_bytes, clip)
    out = {str(dim): t.bytes(dim=dim) for dim in Dim}
    out["total"] = sum(out.values())
    return out


def formula_memory(strategy: StrategyLike, psi: int, psi_trainable: int, n: int, m: int, param_bytes: int = 2,
                   grad_bytes: int = 2, os_bytes: int = 12) -> dict[str, float]:
    """The method's per-rank model-state memory M (module docstring): ``{"P", "G", "OS", "total"}``."""
    return memory_of(_whole_model(strategy, psi, psi_trainable, 0), n, m, param_bytes, grad_bytes, os_bytes)


def buckets_of(model: Any) -> list[Bucket]:
    """The engine's buckets of a sharded model, assuming every block runs backward each micro-step (true
    when it, or a parameter before it, trains); a block that never does is gathered once."""
    state = getattr(model, "_paro_state", None)
    if state is None:
        raise ValueError("buckets_of needs a model returned by paro_shard")
    out = []
    for block in state.blocks:
        for g in block.groups:
            gathers = 0 if g.plan.params_whole else (2 if g.reshard_after_forward and not block.is_root else 1)
            out.append(Bucket(g.strategy, sum(r.numel for r in g.refs), sum(r.numel for r in g.trainable),
                              gathers, len(g.trainable)))
    return out
