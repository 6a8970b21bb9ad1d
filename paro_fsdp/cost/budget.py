"""``strategy="auto"`` under a memory budget: a strategy per block that minimises the predicted step
time with the predicted per-rank peak within the budget (what is counted, how it is solved and its
bounds: docs/advisor.md, "A memory budget").

Why per block: users know a GPU's memory, not which of 27 strategies to run, and a layout between two
strategies' footprints (sharded embeddings, replicated layers; frozen weights at one level, LoRA adapters
at another) is often faster than either; the engine runs it as a per-tensor policy. Every cost comes
from the ledger and the plan, never a table of its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from operator import mul
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from ..mesh import as_2d
from ..models.llama import LlamaArgs
from ..overlap import IN_FLIGHT_BYTES
from ..plan import plan_of
from ..strategy import ALL_STRATEGIES, Level, Strategy, StrategyLike
from .cluster import AdvisorError, Cluster, load_cluster
from .knapsack import DEFAULT_CELLS, BudgetError, Footprint, Option, _size, min_footprint, solve, within
from .ledger import PEAK_MAX, Bucket, backward_moments, peak_of, peak_terms, traffic_of
from .model import ModelSpec, activation_bytes
from .peak_search import PlanPeaks
from .predict import exposed_seconds, moves_seconds, optimizer_seconds, traffic_time
from .workload import Workload, seen_workload, spec_of

__all__ = ["BudgetError", "BudgetPlan", "Footprint", "Option", "Workload", "auto_policy", "min_footprint",
           "plan_blocks", "solve", "units_of"]  # the solver's names re-exported from .knapsack

# A plan per block is taken only where it is predicted this much faster than the fastest single
# strategy that fits. The per-block time prices each block as if it hid its own traffic; a mix runs
# every strategy's collectives, each on its own dimension, and measured (tools.bench --budgets,
# 1.0M Llama, 200 Mbit/s) 6-14% slower than the single strategy it was predicted to beat by 3-4%.
MIX_GAIN = 1.05
_N = Level.N


# ---- the model's items: the root and each block, trainable and frozen tensors apart ------------------------
@dataclass(frozen=True)
class Unit:
    """Tensors of one block that take one strategy: its trainable ones, or its frozen ones."""

    names: tuple[str, ...]
    numel: int
    trainable: bool


@dataclass(frozen=True)
class Block:
    name: str  # "<root>" for the root's parameters
    units: tuple[Unit, ...]
    is_root: bool = False
    prefix: str = ""  # the block's module name: its parameters are "prefix.*"


def units_of(model: Any, block_modules: Sequence[Any]) -> list[Block]:
    """The root and each block as ``api.build`` assigns them, each as its trainable and its frozen tensors."""
    names = {id(mod): n for n, mod in model.named_modules()}
    block_of: dict[int, Any] = {}
    for b in block_modules:
        for p in b.parameters():
            block_of[id(p)] = b
    per: dict[int, list[tuple[str, Any]]] = {id(model): []}
    for b in block_modules:
        per[id(b)] = []
    for fqn, p in model.named_parameters():
        per[id(block_of.get(id(p), model))].append((fqn, p))
    out = []
    for mod in [model, *block_modules]:
        units = []
        for trainable in (True, False):
            ps = [(n, p) for n, p in per[id(mod)] if p.requires_grad == trainable]
            if ps:
                units.append(Unit(tuple(n for n, _ in ps), sum(p.numel() for _, p in ps), trainable))
        if units:
            root = mod is model
            out.append(Block("<root>" if root else names[id(mod)], tuple(units), root, "" if root else names[id(mod)]))
    return out


@dataclass(frozen=True)
class _Env:
    n: int
    m: int
    cluster: Cluster
    work: Workload
    spec: Optional[ModelSpec]
    pb: int  # param (and gather) bytes
    gb: int  # gradient (reduction) bytes
    ab: int  # the G-level accumulator's bytes
    reshard_after_forward: bool
    flat_below_bytes: int
    wire: Optional[str] = None  # MixedPrecision.inter_dtype: what crosses groups, quantized

    def __post_init__(self) -> None:
        w = self.work
        for name, v in (("micro_batch", w.micro_batch), ("seq_len", w.seq_len), ("grad_accum", w.grad_accum)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AdvisorError(f"Workload.{name} must be a positive integer, got {v!r}")
        if self.n % self.m:
            raise AdvisorError(f"group size {self.m} does not divide the world size {self.n}")


def _seconds(env: _Env, moves, psi: float, itemsize: int) -> dict[str, float]:
    return moves_seconds(moves, psi, itemsize, env.n, env.m, env.cluster, env.flat_below_bytes)


def _plus(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {d: a.get(d, 0.0) + b.get(d, 0.0) for d in ("intra", "inter", "global")}


def _flops(env: _Env, block: Block) -> tuple[float, float]:
    """(forward, backward) FLOPs per token of one block: ``model.flops_per_token``'s counts, split."""
    numel = sum(u.numel for u in block.units)
    trainable = sum(u.numel for u in block.units if u.trainable)
    s, seq = env.spec, env.work.seq_len
    if block.is_root:
        mm = s.root_matmul if s else numel
        return 2.0 * mm, 2.0 * mm + (2.0 * mm if trainable else 0.0)
    mm = min(numel, s.layer_matmul) if s else numel
    attn = 4.0 * seq * s.dim if s else 0.0
    fwd, bwd = 2.0 * mm + attn, 2.0 * mm + 2.0 * min(trainable, mm) + 2 * attn
    if env.work.activation_checkpoint:
        bwd += fwd
    return fwd, bwd


def _option(env: _Env, block: Block, position: str, pick: tuple[Strategy, ...]) -> Option:
    """Memory and time of one block under ``pick`` (one strategy per unit)."""
    n, m, pb, gb, ab = env.n, env.m, env.pb, env.gb, env.ab
    by_strategy: dict[Strategy, list[Unit]] = {}
    for u, s in zip(block.units, pick):
        by_strategy.setdefault(s, []).append(u)
    kept = block.is_root or not env.reshard_after_forward
    once = 1 if kept else 2
    gather_t: dict[str, float] = {}
    reduce_t: dict[str, float] = {}
    boundary_t = opt_t = 0.0
    terms = []
    for s, units in by_strategy.items():
        numel = sum(u.numel for u in units)
        tr = sum(u.numel for u in units if u.trainable)
        b = Bucket(s, numel, tr, 0 if s.p == _N else once)
        terms.append(peak_terms(b, n, m, pb, gb, ab, kept, block.is_root))
        plan = plan_of(s, env.wire)
        if s.p != _N:
            gather_t = _plus(gather_t, _seconds(env, plan.gather, numel, pb))
        if tr:
            if s.g != _N:
                reduce_t = _plus(reduce_t, _seconds(env, plan.reduce, tr, gb))
            boundary = traffic_of([b], n, m, 0, pb, gb, flat_below_bytes=env.flat_below_bytes, inter_dtype=env.wire)
            boundary_t += sum(traffic_time(boundary, n, m, env.cluster).values())
            opt_t += optimizer_seconds(tr, s, n, m, gb, env.cluster)
    t = {k: sum(x[k] for x in terms) for k in terms[0]}  # a block's groups: one item, their parts summed
    ckpt = env.work.activation_checkpoint
    tokens = env.work.micro_batch * env.work.seq_len
    c_fwd, c_bwd = (f * tokens / (env.cluster.achieved_tflops * 1e12) for f in _flops(env, block))
    c, A = env.cluster, env.work.grad_accum
    if block.is_root:
        exp_fwd, exp_bwd = sum(gather_t.values()), sum(reduce_t.values())
    else:
        regather = gather_t if once == 2 else {}
        exp_fwd = sum(gather_t.values()) if position in ("first", "only") else exposed_seconds(gather_t, c_fwd, c)
        if position in ("last", "only"):
            exp_bwd = sum(regather.values()) + exposed_seconds(reduce_t, c_bwd, c)
        else:
            exp_bwd = exposed_seconds(_plus(regather, reduce_t), c_bwd, c)
    step = A * (c_fwd + c_bwd + exp_fwd + exp_bwd) + boundary_t + opt_t
    detail = {**t, "compute": A * (c_fwd + c_bwd), "exposed": A * (exp_fwd + exp_bwd) + boundary_t, "optimizer": opt_t}
    return Option(t["states"] + t["kept"], step, tuple(t[k] for k in PEAK_MAX), (t["queue"] if ckpt else 0.0,), pick,
                  detail)


def _picks(block: Block, strategies: Sequence[Strategy], uniform: bool) -> list[tuple[Strategy, ...]]:
    """A strategy for the block's trainable tensors; its frozen tensors' P level (the trainable strategy
    itself where the levels agree: one group, one collective; else P at all three levels)."""
    if not uniform and not any(u.trainable for u in block.units):  # frozen only: the three P levels are the choices
        return [tuple(Strategy.parse(p * 3) for _ in block.units) for p in "NIG"]
    out = []
    for s in strategies:
        frozen = [s] if uniform else [s] + [Strategy.parse(p * 3) for p in "NIG" if p != s.p.value]
        for f in frozen:
            pick = tuple(s if u.trainable else f for u in block.units)
            if pick not in out:
                out.append(pick)
    return out


@dataclass
class BudgetPlan:
    """The chosen strategy per block, its predicted footprint and step time, and the table to print."""

    blocks: list[Block]
    options: list[Option]
    footprint: float
    step_time: float
    budget: float
    breakdown: dict[str, float]
    header: str = ""
    single: list[tuple[str, float, float]] = field(default_factory=list)  # (strategy, footprint, time)

    def strategies(self) -> dict[str, Strategy]:
        """Every parameter name -> its strategy."""
        return {name: s for b, o in zip(self.blocks, self.options) for u, s in zip(b.units, o.label)
                for name in u.names}

    def policy(self) -> dict[str, str]:
        """The plan as a fnmatch policy: ``"prefix.*"`` where a whole block takes one strategy and no block
        lies under it, else its parameter names (escaped)."""
        prefixes = [b.prefix for b in self.blocks if b.prefix]
        out: dict[str, str] = {}
        for b, o in zip(self.blocks, self.options):
            nested = any(p.startswith(b.prefix + ".") for p in prefixes)
            if b.prefix and len(set(o.label)) == 1 and not nested:
                out[_escape(b.prefix) + ".*"] = o.label[0].name
                continue
            for u, s in zip(b.units, o.label):
                out.update({_escape(n): s.name for n in u.names})
        return out

    def table(self) -> str:
        """Per block (equal runs folded): strategy, memory held throughout, time per step; then the peak
        against the budget with its transient parts."""
        rows, i = [], 0
        while i < len(self.blocks):
            j = i + 1
            same = lambda k: self.options[k].label == self.options[i].label and _shape(self.blocks[k]) == _shape(  # noqa: E731
                self.blocks[i])
            while j < len(self.blocks) and not self.blocks[i].is_root and same(j):
                j += 1
            b, o = self.blocks[i], self.options[i]
            name = b.name if j == i + 1 else f"{b.name} .. {self.blocks[j - 1].name} ({j - i})"
            strat = " ".join(f"{s.name}{'' if u.trainable else '(frozen)'}" for u, s in zip(b.units, o.label))
            rows.append(f"  {name[:44]:44} {strat:22} {_size(o.w):>12} {o.t * 1e3:12.4f} ms")
            i = j
        bd = self.breakdown
        total = (f"  total: {_size(self.footprint)} predicted peak per rank of {_size(self.budget)} (states + boundary "
                 f"{_size(bd['additive'])}, gathered {_size(bd['gathered'])}, gradients {_size(bd['gradients'])}, "
                 f"queues {_size(bd['queues'])}, activations {_size(bd['activations'])}); step {self.step_time:.6f} s")
        head = f"  {'block':44} {'strategy':22} {'held':>12} {'time/step':>15}"
        lines = [self.header, head, *rows, total]
        fits = [x for x in self.single if x[1] <= self.budget]
        if fits:
            s, f, t = min(fits, key=lambda x: x[2])
            lines.append(f"  best single strategy that fits: {s} ({_size(f)}, {t:.6f} s/step): "
                         f"the plan is {t / self.step_time:.2f}x its predicted speed")
        return "\n".join(line for line in lines if line)


def _shape(b: Block) -> tuple:
    return tuple((u.numel, u.trainable) for u in b.units)


def _escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _items(env: _Env, blocks: Sequence[Block], strategies: Sequence[Strategy], uniform: bool) -> list[list[Option]]:
    layers = [i for i, b in enumerate(blocks) if not b.is_root]
    cache: dict[tuple, list[Option]] = {}
    out = []
    for i, b in enumerate(blocks):
        pos = "root" if b.is_root else ("only" if len(layers) == 1 else "first" if i == layers[0]
                                        else "last" if i == layers[-1] else "middle")
        key = (_shape(b), b.is_root, pos)
        if key not in cache:
            cache[key] = [_option(env, b, pos, pick) for pick in _picks(b, strategies, uniform)]
        out.append(cache[key])
    return out


def plan_blocks(blocks: Sequence[Block], n: int, m: int, budget: Optional[float], cluster: Cluster,
                workload: Workload = Workload(), spec: Optional[ModelSpec] = None, param_bytes: int = 2,
                grad_bytes: int = 2, acc_bytes: int = 4, reshard_after_forward: bool = True,
                flat_below_bytes: int = 0, strategies: Optional[Iterable[StrategyLike]] = None,
                cells: int = DEFAULT_CELLS, inter_dtype: Optional[str] = None) -> BudgetPlan:
    """The fastest plan within ``budget`` bytes per rank (a strategy per block), or with ``budget=None`` the
    fastest single strategy within the cluster's usable memory; :class:`BudgetError` when nothing fits."""
    env = _Env(n, m, cluster, workload, spec, param_bytes, grad_bytes, acc_bytes, reshard_after_forward,
               flat_below_bytes, inter_dtype)
    cands = [Strategy.parse(s) for s in (strategies or ALL_STRATEGIES)]
    acts, inside, after = (workload.activation_bytes, workload.activations_in_backward,
                           workload.activations_after_backward)
    if acts is None and spec is not None:
        formula = activation_bytes(spec, workload.micro_batch, workload.seq_len, param_bytes,
                                   workload.activation_checkpoint)
        acts, after = formula["peak"], formula["held"]
    acts = float(acts or 0.0)
    ckpt = workload.activation_checkpoint
    (const, coefs), *also = backward_moments(acts, ckpt, inside, after)
    fp = Footprint(const, coefs, (float(IN_FLIGHT_BYTES),), tuple(also))

    def peak(chosen: Sequence[Option]) -> dict[str, float]:  # the three moments: ledger.peak_of
        return peak_of([o.detail for o in chosen], acts, ckpt, float(IN_FLIGHT_BYTES), inside, after)

    uniform, note = budget is None, ""
    limit = cluster.usable_bytes if uniform else float(budget)
    single = []
    for s in cands:  # each single strategy: its footprint and time (printed beside the plan; the no-budget pick)
        items = _items(env, blocks, [s], True)
        chosen = [opts[0] for opts in items]
        single.append((s.name, peak(chosen)["peak"], sum(o.t for o in chosen)))
    fits = [x for x in single if x[1] <= limit]
    best = min(fits, key=lambda x: x[2]) if fits else None
    if uniform and best is None:
        s, f, _ = min(single, key=lambda x: x[1])
        raise BudgetError(f"no single strategy fits in {_size(limit)} per rank ({cluster.name}'s usable memory): "
                          f"the smallest footprint is {_size(f)}, with {s}; pass memory_budget= for a plan per block, "
                          f"or use activation checkpointing, a smaller micro-batch or more ranks")
    if not uniform:
        items = _items(env, blocks, cands, False)
        search = PlanPeaks(items, acts, ckpt, float(IN_FLIGHT_BYTES), inside, after)
        found = within(items, fp, limit, cells, search.peak)  # the knapsack's, where the backward's moment binds
        if found is not None:
            idx = list(found[0])
        else:  # every moment priced: the smallest plan fits any budget at or above it, and a refusal names it
            small, plan = search.smallest([min_footprint(items, fp)[1]])
            if limit < small:
                raise BudgetError(f"memory_budget = {_size(limit)} per rank is too small: the smallest footprint "
                                  f"possible is {_size(small)}, with {_describe(blocks, items, plan)}; raise the "
                                  f"budget, use activation checkpointing, a smaller micro-batch or more ranks", small)
            fastest = solve(items, limit, fp, cells)
            idx = search.fastest(limit, ([fastest[0]] if fastest else []) + [plan]) or plan
        plan_t = search.time(idx)
        if best is not None and best[2] <= plan_t * MIX_GAIN:  # a mix must gain clearly, else the single
            uniform, note = True, (f" (a plan per block was predicted {best[2] / plan_t:.3f}x faster, under the "
                                   f"{MIX_GAIN:.2f}x a mix must gain)")
    if uniform:
        items = _items(env, blocks, [Strategy.parse(best[0])], True)
        idx = [0] * len(items)
    else:
        groups: dict[int, list[int]] = {}  # identical blocks (one shared option list) cost the same in any order:
        for k, opts in enumerate(items):  # their choices sorted, so the plan reads as runs
            groups.setdefault(id(opts), []).append(k)
        for ks in groups.values():
            for k, i in zip(ks, sorted(idx[k] for k in ks)):
                idx[k] = i
    chosen = [opts[i] for opts, i in zip(items, idx)]
    tops = [max(o.peaks[d] for o in chosen) for d in range(len(fp.coefs))]
    held_acts, coefs = max(((fp.const, fp.coefs), *fp.also), key=lambda x: x[0] + sum(map(mul, x[1], tops)))
    breakdown = {"additive": sum(o.w for o in chosen), "gathered": coefs[0] * tops[0],  # the larger moment's parts
                 "gradients": sum(map(mul, coefs[1:], tops[1:])),
                 "queues": sum(min(cap, sum(o.queues[j] for o in chosen)) for j, cap in enumerate(fp.caps)),
                 "activations": held_acts, **peak(chosen)}
    what = f"the fastest single strategy that fits{note}" if uniform else "a strategy per block"
    acts_note = "" if spec is not None or workload.activation_bytes is not None else \
        " (activations not modelled: pass Workload(example_inputs=<one micro-batch>) to measure them)"
    header = (f"paro auto: {what}, {n} ranks = {n // m} groups x {m}, micro-batch {workload.micro_batch} x "
              f"{workload.seq_len}, {workload.grad_accum} micro-steps, activation checkpointing "
              f"{'on' if workload.activation_checkpoint else 'off'}, cluster {cluster.name}{acts_note}")
    return BudgetPlan(list(blocks), chosen, breakdown["peak"], sum(o.t for o in chosen), limit, breakdown, header,
                      single)


def _describe(blocks: Sequence[Block], items, plan: Sequence[int]) -> str:
    """A plan in a few words: its one strategy, or each strategy and how many blocks take it."""
    names = [" ".join(s.name for s in items[k][i].label) for k, i in enumerate(plan)]
    kinds = sorted(set(names))
    if len(kinds) == 1:
        return f"{kinds[0]} on every block"
    return ", ".join(f"{k} on {names.count(k)} of {len(blocks)} blocks" for k in kinds)


# ---- the API's entry: cluster, rank 0's plan for every rank, printed ----------------------------------------
def auto_policy(model: Any, mesh: Any, block_modules: Sequence[Any], memory_budget: Optional[float],
                mp: Any, workload: Optional[Workload] = None, cluster: Union[Cluster, str, os.PathLike, None] = None,
                reshard_after_forward: bool = True, flat_below_bytes: int = 0,
                log: Optional[Callable[[str], None]] = None) -> dict[str, str]:
    """``strategy="auto"``: the plan for ``model`` on ``mesh`` as a per-tensor policy. ``cluster``: a
    ``Cluster``, TOML file or preset, or None for this mesh's cached calibration (collective; rank 0's for
    all). Rank 0 prints the plan (``log``, default ``print``)."""
    import torch.distributed as dist

    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not memory_budget > 0):
        raise ValueError(f"memory_budget={memory_budget!r}: give bytes per rank as a positive number "
                         f"(e.g. 40 * 2**30), or None for the fastest single strategy that fits")
    if workload is not None and not isinstance(workload, Workload):
        raise TypeError(f"workload= takes a paro_fsdp.cost.budget.Workload, got {type(workload).__name__}")
    spec = spec_of(model, workload or Workload())
    work, seen = seen_workload(model, workload, spec, mp.param_dtype, memory_budget is not None, block_modules)
    mesh2 = as_2d(mesh)
    n, m = mesh2.size(), mesh2.size(1)
    pb, gb, ab = mp.param_dtype.itemsize, mp.grad_dtype.itemsize, mp.acc_dtype.itemsize
    rank = dist.get_rank() if dist.is_initialized() else 0
    source = ""
    if isinstance(cluster, Cluster):
        c = cluster
    elif cluster is not None:
        c = load_cluster(cluster)
    else:  # this mesh calibrated, or read from the calibration cache (``calibration_cache``): rank 0's for all
        from .calibration_cache import cached_calibration

        args = None
        if spec is not None:
            args = LlamaArgs(dim=spec.dim, n_layers=spec.n_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
                             ffn_dim=spec.ffn_dim, vocab_size=spec.vocab_size)
        dtype = {1: "fp8", 2: "bf16", 4: "fp32"}.get(pb, "fp32")
        if tuple(mesh2.mesh_dim_names) != ("inter", "intra"):
            raise ValueError(f"strategy='auto' without cluster= calibrates the mesh, which needs the dimension names "
                             f"('inter', 'intra') (init_paro_mesh's), got {mesh2.mesh_dim_names}; pass "
                             f"cluster=<a TOML file or preset> or a mesh from init_paro_mesh")
        calibrated = cached_calibration(mesh2, args, work.micro_batch, work.seq_len, dtype)
        c, source = calibrated.cluster, f"paro auto: {calibrated.source}\n"
    blocks = units_of(model, block_modules)
    plan = plan_blocks(blocks, n, m, memory_budget, c, work, spec, pb, gb, ab, reshard_after_forward,
                       flat_below_bytes, inter_dtype=mp.inter_dtype)
    plan.header += seen
    from .workload_probe import watch_first_step

    watch_first_step(model, work.micro_batch, work.seq_len, work.grad_accum, announce=rank == 0)
    if rank == 0:
        (log or print)(source + plan.table())
    policy = plan.policy()
    if dist.is_initialized() and dist.get_world_size() == n > 1:  # rank 0's plan for every rank: a measurement
        box = [policy]  # that differs by a byte (a real forward's) must not give ranks different collectives
        dist.broadcast_object_list(box, src=0)
        policy = box[0]
    return policy
