"""The strategy advisor's time model: the method's guideline as a calibrated cost model.

Why: PaRO's benefit depends on the model, the cluster and the batch, so the user (and ``"auto"``)
needs to know which of the 27 strategies to run before renting GPUs. Model states and bytes are the
ledger's, exact for the engine.

Memory per GPU = the peak of a step, ``ledger.peak_of``, with ``model.activation_bytes``; it fits
  when at most ``memory_gib x usable_memory_fraction``.
Step time = A x (compute_fwd + compute_bwd + exposed_fwd + exposed_bwd) + boundary + optimizer.
  Compute: ``model.flops_per_token`` / ``achieved_tflops``. Communication: hops x latency + ring
  bytes / bandwidth on the links each mesh dimension's rings use (``cluster.link_for``).
  Per micro-step collectives hide behind up to ``overlap`` of that micro-step's compute (each
  mesh dimension its own, ``exposed_seconds``), except what cannot be prefetched (forward: the
  root's and the first layer's gathers; backward: the first re-gathered layer and the last
  reduction): exposed = first + max(0, rest - overlap x compute). Boundary collectives and the
  optimizer (AdamW on the OS shard, (28 + grad bytes) bytes per element / ``memory_bandwidth_gbs``)
  are fully exposed.
Not modelled: framework overhead, accumulation adds, stragglers, congestion beyond the per-node
NIC share, PaRO-CC's chunked overlap of one collective's phases.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Iterable, Optional, Sequence, Union

from ..collectives import CommStats, Dim, Kind, check_wire, hops
from ..dtypes import dtype_of
from .ledger import Ledger, memory_of, peak_of, peak_terms, traffic_of
from ..models.llama import LlamaArgs
from ..overlap import IN_FLIGHT_BYTES
from ..plan import Move, plan_of
from ..strategy import ALL_STRATEGIES, Level, Strategy, StrategyLike
from .cluster import GB, AdvisorError, Cluster, GiB, link_for, link_seconds, load_cluster
from .model import ModelSpec, activation_bytes, buckets, flops_per_token, model_spec

__all__ = ["ACTIVATION_CHECKPOINT_MODES", "NAMED_STRATEGIES", "Prediction", "choose_strategy", "exposed_seconds",
           "format_table", "moves_seconds", "optimizer_seconds", "predict", "rank_strategies",
           "traffic_time"]

ACTIVATION_CHECKPOINT_MODES = ("none", "full", "auto")
NAMED_STRATEGIES = ("NNN", "NNG", "NGG", "GGG", "III", "NIG", "IIG", "IGG", "ING")
OS_BYTES = 12  # fp32 master + AdamW's two fp32 moments: the method's K
_N = Level.N


@dataclass
class Prediction:
    """One strategy's predicted cost; times in seconds, memory and traffic in bytes, per GPU."""

    strategy: str
    known_as: str
    step_time: float
    tokens_per_step: int
    compute: float
    exposed_comm: float  # per step: A x exposed per micro-step + boundary collectives
    optimizer: float
    comm_total: float  # all collective time per step, hidden or not
    memory: dict[str, float]  # P, G, OS, master_grads, states, activations, backward, boundary, push, peak = total
    fits: bool
    activation_checkpoint: bool
    traffic: CommStats
    breakdown: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def intra_bytes(self) -> float:
        return self.traffic.bytes(dim=Dim.INTRA)

    @property
    def inter_bytes(self) -> float:
        return self.traffic.bytes(dim=Dim.INTER)

    @property
    def global_bytes(self) -> float:
        return self.traffic.bytes(dim=Dim.GLOBAL)


def _check_sizes(n: int, m: int, micro_batch: int, grad_accum: int, seq_len: int) -> None:
    for name, v in (("number of GPUs", n), ("group size", m), ("micro-batch", micro_batch),
                    ("gradient accumulation", grad_accum), ("seq_len", seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise AdvisorError(f"{name} must be a positive integer, got {v!r}")
    if n % m:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise AdvisorError(f"group size {m} does not divide the number of GPUs {n}; valid group sizes: {divisors}")


def _itemsize(dtype: str) -> int:
    try:
        return dtype_of(dtype).itemsize
    except ValueError as exc:  # the advisor's callers expect its one error type
        raise AdvisorError(str(exc)) from None


def traffic_time(t: CommStats, n: int, m: int, cluster: Cluster) -> dict[str, float]:
    """Seconds per mesh dimension for the collectives in ``t`` (alpha-beta ring model) on the
    (n / m, m) mesh, each dimension on the links its rings use (``link_for`` with the mesh shape)."""
    g = n // m
    out = {str(d): 0.0 for d in Dim}
    for key, e in t.as_dict().items():
        kind, dim = (c(x) for c, x in zip((Kind, Dim), key.split("/")))
        if dim == Dim.GLOBAL:  # a flat collective over all ranks: a hierarchical all-reduce's latency
            ar = Kind.ALL_REDUCE
            lat = sum(hops(ar, k) * link_for(d, cluster, n, m).cost(ar)[1] for d, k in ((Dim.INTRA, m), (Dim.INTER, g)))
            out[dim] += e["count"] * lat + e["bytes"] / link_for(Dim.INTER, cluster, n, m).cost(ar)[0]
        else:
            out[dim] += link_seconds(link_for(dim, cluster, n, m), kind, m if dim == Dim.INTRA else g, e["bytes"],
                                     e["count"])
    return out


def moves_seconds(moves: Iterable[Move], psi: float, itemsize: int, n: int, m: int, cluster: Cluster,
                  flat_below_bytes: int = 0) -> dict[str, float]:
    """Seconds per mesh dimension of one run of a plan phase on a bucket of ``psi`` elements."""
    t = Ledger(n, m, flat_below_bytes)
    t.count(moves, psi, itemsize)
    return traffic_time(t.stats, n, m, cluster)


def optimizer_seconds(psi_trainable: float, s: Strategy, n: int, m: int, grad_bytes: int, cluster: Cluster) -> float:
    """AdamW over the OS shard, memory bound: (28 + grad bytes) bytes per element."""
    return psi_trainable / s.os.divisor(n, m) * (28 + grad_bytes) / (cluster.memory_bandwidth_gbs * GB)


def exposed_seconds(by_dim: dict[str, float], compute: float, cluster: Cluster) -> float:
    """What of ``by_dim`` (seconds per mesh dimension) does not hide behind ``compute``: each dimension hides
    up to its ``cluster.overlap_of`` of it, the slow (inter, flat) traffic first, intra in what it leaves."""
    slow, fast = by_dim.get(Dim.INTER, 0.0) + by_dim.get(Dim.GLOBAL, 0.0), by_dim.get(Dim.INTRA, 0.0)
    phi_slow, phi_fast = cluster.overlap_of(Dim.INTER), cluster.overlap_of(Dim.INTRA)
    hid_slow = min(slow, phi_slow * compute)
    left = max(0.0, compute - hid_slow / phi_slow) if phi_slow > 0 else compute
    return slow + fast - hid_slow - min(fast, phi_fast * left)


def predict(model: Union[str, LlamaArgs, ModelSpec], strategy: StrategyLike, n: int, m: int, micro_batch: int,
            grad_accum: int, seq_len: int, cluster: Cluster, trainable_fraction: float = 1.0, dtype: str = "bf16",
            reduce_dtype: Optional[str] = None, activation_checkpoint: str = "none",
            reshard_after_forward: bool = True, accumulate_dtype: Optional[str] = "fp32",
            inter_dtype: Optional[str] = None) -> Prediction:
    """Predicted memory and step time of one strategy (the module docstring's model).
    ``activation_checkpoint``: "none", "full" or "auto" (full only if needed to fit); ``dtype`` /
    ``reduce_dtype`` / ``accumulate_dtype`` (None: the reduce dtype): of P / the gradients / G;
    ``inter_dtype``: priced on its bytes on the wire (not the quantization's arithmetic)."""
    try:
        check_wire(inter_dtype)
    except ValueError as exc:  # the advisor's callers expect its one error type
        raise AdvisorError(str(exc)) from None
    spec = model_spec(model, trainable_fraction)
    _check_sizes(n, m, micro_batch, grad_accum, seq_len)
    if activation_checkpoint not in ACTIVATION_CHECKPOINT_MODES:
        raise AdvisorError(f"activation_checkpoint must be one of {ACTIVATION_CHECKPOINT_MODES}, "
                           f"got {activation_checkpoint!r}")
    pb, gb = _itemsize(dtype), _itemsize(reduce_dtype or dtype)
    ab = _itemsize(accumulate_dtype or reduce_dtype or dtype)
    if activation_checkpoint == "auto":  # full only if needed to fit
        again = partial(predict, spec, strategy, n, m, micro_batch, grad_accum, seq_len, cluster, dtype=dtype,
                        reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward,
                        accumulate_dtype=accumulate_dtype, inter_dtype=inter_dtype)
        pred = again(activation_checkpoint="none")
        return pred if pred.fits else again(activation_checkpoint="full")
    ckpt = activation_checkpoint == "full"
    s = Strategy.parse(strategy)
    A = grad_accum
    bks = buckets(spec, s, reshard_after_forward)

    mem = memory_of(bks, n, m, pb, ab, OS_BYTES)
    states = mem.pop("total")
    act = activation_bytes(spec, micro_batch, seq_len, pb, ckpt)
    acts = act["peak"]
    terms = [peak_terms(b, n, m, pb, gb, ab, i == 0 or not reshard_after_forward, i == 0) for i, b in enumerate(bks)]
    peak = peak_of(terms, acts, ckpt, IN_FLIGHT_BYTES, after_backward=act["held"])
    memory = {**mem, "states": states, "activations": acts, **peak, "total": peak["peak"]}

    traffic = traffic_of(bks, n, m, A, pb, gb, inter_dtype=inter_dtype)
    boundary = traffic_of(bks, n, m, 0, pb, gb, inter_dtype=inter_dtype)  # A = 0: the once-per-step collectives

    seconds = partial(moves_seconds, n=n, m=m, cluster=cluster)
    def total(*parts: dict[str, float], times: Sequence[float] = ()) -> dict[str, float]:
        k = list(times) or [1.0] * len(parts)
        return {str(d): sum(w * p[d] for w, p in zip(k, parts)) for d in Dim}

    zero = total()
    plan = plan_of(s, inter_dtype)
    gathers = [seconds(plan.gather, b.numel, pb) for b in bks]  # root, then the layers (all alike)
    reductions = [seconds(plan.reduce, b.trainable, gb) if b.trainable else zero for b in bks]
    g_layer = gathers[1] if len(bks) > 1 else zero
    bwd_first = g_layer if len(bks) > 1 and bks[1].gathers == 2 else zero  # the first layer re-gathered
    fwd_first = total(gathers[0], g_layer)
    fwd_rest = total(*gathers, fwd_first, times=[1.0] * len(gathers) + [-1.0])
    # backward finishes with the root's reduction (its embedding gradient comes last), or, when
    # the root is frozen, with the earliest trainable layer's
    last_red = reductions[0] if bks[0].trainable else (reductions[1] if len(reductions) > 1 else zero)
    bwd_rest = total(bwd_first, *reductions, bwd_first, last_red,
                     times=[len(bks) - 1] + [1.0] * len(reductions) + [-1.0, -1.0])
    fwd_all, bwd_all = sum(total(fwd_first, fwd_rest).values()), sum(total(bwd_first, last_red, bwd_rest).values())

    tokens = micro_batch * seq_len
    c_fwd, c_bwd = (f * tokens / (cluster.achieved_tflops * 1e12) for f in flops_per_token(spec, seq_len, ckpt))
    exp_fwd = sum(fwd_first.values()) + exposed_seconds(fwd_rest, c_fwd, cluster)
    exp_bwd = sum(bwd_first.values()) + sum(last_red.values()) + exposed_seconds(bwd_rest, c_bwd, cluster)
    t_boundary = sum(traffic_time(boundary, n, m, cluster).values())
    t_opt = optimizer_seconds(spec.psi_trainable, s, n, m, gb, cluster)
    step = A * (c_fwd + c_bwd + exp_fwd + exp_bwd) + t_boundary + t_opt
    return Prediction(
        strategy=s.name, known_as=s.known_as, step_time=step, tokens_per_step=n * A * tokens,
        compute=A * (c_fwd + c_bwd), exposed_comm=A * (exp_fwd + exp_bwd) + t_boundary, optimizer=t_opt,
        comm_total=A * (fwd_all + bwd_all) + t_boundary, memory=memory,
        fits=memory["total"] <= cluster.usable_bytes, activation_checkpoint=ckpt, traffic=traffic,
        breakdown={"compute_fwd": c_fwd, "compute_bwd": c_bwd, "exposed_fwd": exp_fwd, "exposed_bwd": exp_bwd,
                   "comm_fwd": fwd_all, "comm_bwd": bwd_all, "boundary": t_boundary, "optimizer": t_opt},
    )


def rank_strategies(model: Union[str, LlamaArgs, ModelSpec], n: int, m: int, micro_batch: int, grad_accum: int,
                    seq_len: int, cluster: Cluster, trainable_fraction: float = 1.0, dtype: str = "bf16",
                    reduce_dtype: Optional[str] = None, activation_checkpoint: str = "auto",
                    reshard_after_forward: bool = True,
                    strategies: Optional[Iterable[StrategyLike]] = None,
                    inter_dtype: Optional[str] = None) -> list[Prediction]:
    """Every strategy's prediction, ranked: those that fit by step time, then the OOM ones."""
    spec = model_spec(model, trainable_fraction)
    names = [Strategy.parse(x).name for x in (strategies or ALL_STRATEGIES)]
    preds = [predict(spec, x, n, m, micro_batch, grad_accum, seq_len, cluster, dtype=dtype,
                     reduce_dtype=reduce_dtype, activation_checkpoint=activation_checkpoint,
                     reshard_after_forward=reshard_after_forward, inter_dtype=inter_dtype) for x in names]
    return sorted(preds, key=lambda p: (not p.fits, p.step_time, p.memory["total"]))


def format_table(preds: Sequence[Prediction], cluster: Optional[Cluster] = None, header: str = "") -> str:
    """The ranked predictions as the advisor's table: GiB and GB per GPU per step, or MiB / MB when small."""
    base = next((p for p in preds if p.strategy == "GGG"), None)
    big_mem = max((p.memory["total"] for p in preds), default=0) >= GiB / 8
    big_comm = max((p.intra_bytes + p.inter_bytes for p in preds), default=0) >= GB / 8
    mu, ms = ("GiB", GiB) if big_mem else ("MiB", 2**20)
    cu, cs = ("GB", GB) if big_comm else ("MB", 1e6)
    lines = [header] if header else []
    head = (f"{'#':>2} {'strat':5} {'known as':16} {'step s':>8} {'tokens/s':>10} {'vs GGG':>7} {'mem ' + mu:>8} "
            f"{'fits':>4} {'AC':>2} {'intra ' + cu:>9} {'inter ' + cu:>9} {'exposed':>8} {'compute':>8}")
    lines += [head, "-" * len(head)]
    for i, p in enumerate(preds, 1):
        vs = f"{base.step_time / p.step_time:6.2f}x" if base else "   -   "
        fits, ac = "yes" if p.fits else "OOM", "on" if p.activation_checkpoint else "-"
        lines.append(
            f"{i:>2} {p.strategy:5} {p.known_as[:16]:16} {p.step_time:8.3f} {p.tokens_per_s:10.0f} {vs:>7} "
            f"{p.memory['total'] / ms:8.1f} {fits:>4} {ac:>2} "
            f"{p.intra_bytes / cs:9.2f} {p.inter_bytes / cs:9.3f} {p.exposed_comm:8.3f} {p.compute:8.3f}")
    if cluster is not None:
        c = cluster
        lines.append(f"(memory: model states + gathered params + grad working set + activations; fits = at most "
                     f"{c.usable_bytes / GiB:.1f} GiB = {c.usable_memory_fraction:.0%} of {c.memory_gib:g} GiB; "
                     f"{cu} sent per GPU per step; exposed = communication not hidden behind compute, s/step; "
                     f"AC = activation checkpointing)")
    return "\n".join(lines)


def choose_strategy(model_args: Union[str, LlamaArgs, ModelSpec], n: int, m: int, micro_batch: int, grad_accum: int,
                    seq_len: int, dtype: str, cluster: Union[Cluster, str, os.PathLike],
                    trainable_fraction: float = 1.0, reduce_dtype: Optional[str] = None,
                    activation_checkpoint: str = "none", reshard_after_forward: bool = True,
                    strategies: Optional[Iterable[StrategyLike]] = None,
                    inter_dtype: Optional[str] = None) -> tuple[Strategy, str]:
    """The fastest strategy that fits and the ranked table to log (the trainer's ``auto``, which passes what
    the run will do); :class:`AdvisorError` when none fits, naming the smallest memory need."""
    c = load_cluster(cluster) if not isinstance(cluster, Cluster) else cluster
    spec = model_spec(model_args, trainable_fraction)
    preds = rank_strategies(spec, n, m, micro_batch, grad_accum, seq_len, c, trainable_fraction, dtype,
                            reduce_dtype, activation_checkpoint, reshard_after_forward, strategies, inter_dtype)
    size = f"{spec.psi / 1e9:.3f} B" if spec.psi >= 1e8 else f"{spec.psi / 1e6:.3f} M"
    header = (f"advisor: {spec.name} ({size} params, {spec.psi_trainable / spec.psi:.1%} trainable), "
              f"{n} GPUs = {n // m} groups x {m}, micro-batch {micro_batch} x {seq_len} tokens, "
              f"{grad_accum} micro-steps, {dtype}/{reduce_dtype or dtype}"
              f"{f', {inter_dtype} between groups' if inter_dtype else ''}, cluster {c.name}")
    table = format_table(preds, c, header)
    best = preds[0]
    if not best.fits:
        small = min(preds, key=lambda p: p.memory["total"])
        raise AdvisorError(f"no strategy fits in {c.usable_bytes / GiB:.1f} GiB per GPU: the smallest, "
                           f"{small.strategy}, needs {small.memory['total'] / GiB:.1f} GiB (try activation "
                           f"checkpointing, a smaller micro-batch or more GPUs)\n{table}")
    return Strategy.parse(best.strategy), table
