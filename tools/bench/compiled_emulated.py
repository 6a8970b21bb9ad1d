"""The compiled variants on the emulated cluster: ``python -m tools.bench --compiled`` (the driver,
emulator and result line are ``headline.py``'s; this is the per-rank side; README "Compiled
variants on the emulator" says what the columns mean).

    sudo .venv/bin/python -m tools.bench --compiled          # GGG,IGG,IIG,NIG,NII + FSDP2, 1gbit, A = 2
    sudo .venv/bin/python -m tools.bench --compiled --quick --backend aot --rounds 1   # a smoke
    sudo .venv/bin/python -m tools.bench --compiled --compile-cache /tmp/c  # twice: warm first steps

Why: compiling must pay for itself on the link it is meant for. Per strategy
(``--variants``): ``eager``; ``compiled`` (``passes.compile_model(model, (), scope="model")``, the
push to P compiled too; no graph pass: the traced path emits PaRO-CC's phases itself); ``bucketing`` /
``reorder`` (that pass alone); ``all`` (``passes.ORDER``). Per FSDP2 baseline (``--baselines``):
eager and per-block compile (its graphs hold no collectives). Every PaRO variant trains the FSDP2
way: torch's AdamW over ``model.parameters()``, torch's ``clip_grad_norm_``,
``set_requires_gradient_sync`` on the last micro-step.

Protocol: ``torch._dynamo.reset()`` once, before any model is sharded (never after: PaRO's
gradient sinks are made by a compile-start callback that reset drops); every model built; each
variant's first step alone ("first s": it compiles; slowest rank); warm-up and timed rounds of
all variants interleaved (order reversed every other round; barrier to end of ``optimizer.step``,
slowest rank; node 0's tx counters around it); then one profiled step per variant
(``--no-timeline``: none), rank 0's trace drawn by ``paro_fsdp.train.timeline`` over the node-0
uplink's tx counter sampled every ~2 ms, one PNG per variant in ``--out-dir``.

Each compiled variant's ``ParoPasses`` (``[]`` for ``compiled``) is bound to its compiles by
``compile_model`` (inductor ``options={"post_grad_custom_post_pass": ...}``, which also patches the backward
compiled later; ``--backend aot``: ``passes.aot_backend``): no process-wide setting, and no
variant's cache entry serves another. Shapes are static (``automatic_dynamic_shapes`` off: the
variants share code objects, and a size another model had must not make a graph dynamic); the
recompile limit is raised and hitting it fails (never run eager as compiled).

Compile accounting (``Compiles``): graphs dynamo captured in the first step (A > 1: the model,
again for the last micro-step, what the hooks compile apart, the push graph) and later (should be
0); recompilations: compilations of a function whose cache entry *of this variant* failed a guard,
with those guards (dynamo's recompile log, captured; its compile ids tell this variant's entries
from the others'). A first capture of a function another variant compiled is not one. Variants
share the per-rank inductor cache: kernels an earlier variant built are reused, so for one
variant's own cold time run it alone (``--strategies X --variants Y --baselines ''``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .compiled_emulated_report import MODES, format_table, label, link_series, parse_recompile, slug, write_timeline_png
from tools.emulate.emulator import local_tx_bytes, parse_rate
from tools.emulate.gloo_rs import install_from_env
from .headline_worker import RESULT_TAG
from .workload import LR, MAX_NORM, WD, make_model

PASSES_OF = {"compiled": (), "bucketing": ("bucketing",), "reorder": ("reorder",), "all": None}  # None: passes.ORDER
FSDP2_KINDS = ("fsdp2-zero3", "fsdp2-hsdp", "fsdp2-hpz")


# ---- compile accounting ------------------------------------------------------------------------
_RECOMPILES: list[str] = []
_SEEN: set[str] = set()  # compile ids already attributed to a variant


class _Capture(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _RECOMPILES.append(record.getMessage())


def capture_recompiles() -> None:
    """Route dynamo's recompile log (one message per recompilation, naming every cache entry
    that failed and why) here instead of stderr, and keep every compile's metrics; once per process."""
    import torch._dynamo.guards as guards
    from torch._dynamo.utils import set_compilation_metrics_limit

    torch._logging.set_logs(recompiles=True)
    if not any(isinstance(h, _Capture) for h in guards.recompiles_log.handlers):
        guards.recompiles_log.addHandler(_Capture())
    guards.recompiles_log.propagate = False
    set_compilation_metrics_limit(1 << 20)


@dataclass
class Compiles:
    """What one variant compiled (the module docstring says what counts as a recompilation)."""
    graphs: int = 0  # graphs dynamo captured
    recompiles: int = 0
    frames: list[str] = field(default_factory=list)  # each compiled frame: "function (file:line)"
    reasons: list[str] = field(default_factory=list)  # one per recompilation
    cache_hits: int = 0  # inductor FX-graph cache
    cache_misses: int = 0


@contextlib.contextmanager
def watch_compiles(into: Compiles, own: set[str]):
    """Add what dynamo compiled inside the block to ``into``; ``own``: the compile ids of this
    variant (updated), which tell its own cache entries from other variants' in the reasons."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    def now():
        return (counters["stats"]["unique_graphs"], counters["inductor"]["fxgraph_cache_hit"],
                counters["inductor"]["fxgraph_cache_miss"], len(_RECOMPILES))

    g, h, m, r = now()
    # what dynamo recorded before (earlier work in this process, never inside a watch; held, so no
    # new record can take an old one's id): not this block's, though its compile id may be unseen
    before = get_compilation_metrics()
    try:
        yield into
    finally:
        g2, h2, m2, r2 = now()
        into.graphs += g2 - g
        into.cache_hits += h2 - h
        into.cache_misses += m2 - m
        old = {id(c) for c in before}
        for c in get_compilation_metrics():
            if c.compile_id is not None and id(c) not in old and str(c.compile_id) not in _SEEN:
                _SEEN.add(str(c.compile_id))
                own.add(str(c.compile_id))
                into.frames.append(f"{c.co_name} ({os.path.basename(str(c.co_filename))}:{c.co_firstlineno})")
        for message in _RECOMPILES[r:r2]:
            where, failed = parse_recompile(message)
            mine = list(dict.fromkeys(reason for cid, reason in failed if cid in own))
            if mine:
                into.recompiles += 1
                into.reasons.append(f"{where}: " + " | ".join(x[:200] for x in mine))


# ---- the link, sampled ------------------------------------------------------------------------
class LinkSampler(threading.Thread):
    """The summed tx counters of ``ifnames`` every ``period`` s: (ms since ``t0``, bytes)."""

    def __init__(self, ifnames: list[str], t0: float, period: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.ifnames, self.t0, self.period = ifnames, t0, period
        self.samples = [((time.perf_counter() - t0) * 1e3, sum(local_tx_bytes(ifnames).values()))]
        self.stop = threading.Event()  # (the first sample here: the thread may start late, behind the GIL)

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.sample()
        self.sample()

    def sample(self) -> None:
        b = sum(local_tx_bytes(self.ifnames).values())
        self.samples.append(((time.perf_counter() - self.t0) * 1e3, b))


# ---- variants -----------------------------------------------------------------------------------
@dataclass
class Variant:
    kind: str  # "paro" | "fsdp2"
    group: str  # strategy or baseline: ratios compare variants of one group
    mode: str  # MODES
    step_fn: Callable[[int, int], float]
    record: Any = None  # its ParoPasses (what each graph's collectives looked like)
    first_s: float = 0.0
    times: list[float] = field(default_factory=list)
    sent: list[dict[str, int]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    first: Compiles = field(default_factory=Compiles)
    later: Compiles = field(default_factory=Compiles)
    compile_ids: set[str] = field(default_factory=set)
    timeline: dict | None = None
    n: int = 0
    error: str | None = None

    def row(self) -> dict:
        return {"kind": self.kind, "group": self.group, "mode": self.mode}


def _train_step(call, opt, clip, batch, before_micro=None) -> Callable[[int, int], float]:
    def step(i: int, accum: int) -> float:
        total = 0.0
        for a in range(accum):
            if before_micro is not None:
                before_micro(a, accum)
            loss = call(batch(i, a)).loss / accum
            loss.backward()
            total += loss.item()
        clip()
        opt.step()
        opt.zero_grad()
        return total
    return step


def build_variants(args: argparse.Namespace, margs, mesh, fsdp_mesh: Callable[[str], Any], batch) -> list[Variant]:
    import passes
    from paro_fsdp import paro_shard
    from torch.distributed.fsdp import fully_shard

    modes = [m for m in MODES if m in args.variants.split(",")]
    out: list[Variant] = []
    for s in filter(None, args.strategies.split(",")):
        for mode in modes:
            model = paro_shard(make_model(margs), mesh, s)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
            call, record = model, None
            if mode != "eager":
                names = passes.ORDER if PASSES_OF[mode] is None else PASSES_OF[mode]
                # the passes bound to this model's compiles (inductor: its config patch, also for the
                # backward compiled later): no process-wide setting, and no variant's cache entry can
                # serve another; the push to P after each optimizer step is one graph too
                record = passes.compile_model(model, names, scope="model", backend=args.backend)
            # every mode: the boundary under the last micro-step's backward (gradients stay at G before it)
            before = lambda a, accum, model=model: model.set_requires_gradient_sync(a == accum - 1)  # noqa: E731
            clip = lambda model=model: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # noqa: E731
            out.append(Variant("paro", s, mode, _train_step(call, opt, clip, batch, before), record))
    fsdp2_modes = (["eager"] if "eager" in modes else []) + (["compiled"] if set(modes) - {"eager"} else [])
    for kind in filter(None, args.baselines.split(",")):
        for mode in fsdp2_modes:
            model = make_model(margs)
            m = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks_per_node))
            raf = m if kind == "fsdp2-hpz" else True
            for layer in model.layers:
                fully_shard(layer, mesh=fsdp_mesh(kind), reshard_after_forward=raf)
            fully_shard(model, mesh=fsdp_mesh(kind), reshard_after_forward=True)
            if mode == "compiled":
                for layer in model.layers:
                    layer.compile(backend="aot_eager" if args.backend == "aot" else "inductor")
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
            before = ((lambda a, accum, model=model: model.set_requires_all_reduce(a == accum - 1))
                      if kind == "fsdp2-hsdp" else None)
            clip = lambda model=model: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # noqa: E731
            out.append(Variant("fsdp2", kind, mode, _train_step(model, opt, clip, batch, before)))
    return out


# ---- worker -------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from paro_fsdp import init_paro_mesh
    from paro_fsdp.models.llama import LlamaArgs
    from paro_fsdp._compat import isolate_compile_cache
    from paro_fsdp.train import timeline as T

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    install_from_env()
    n, rank = dist.get_world_size(), dist.get_rank()
    m = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks_per_node))
    isolate_compile_cache(rank)
    torch._dynamo.reset()  # before any paro_shard, never after (it drops the sinks' compile-start callback)
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._dynamo.config.automatic_dynamic_shapes = False
    capture_recompiles()
    mesh = init_paro_mesh(m)
    margs = LlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      vocab_size=args.vocab, ffn_dim=args.ffn, max_seq_len=args.seq)
    accum = int(args.accum)
    uplinks = sorted(set(filter(None, os.environ.get("PARO_EMU_IFNAMES", "").split(","))))
    on_emulator = bool(uplinks)
    rate_bps = parse_rate(os.environ["PARO_EMU_RATE"]) if os.environ.get("PARO_EMU_RATE") else 0.0

    def batch(i: int, a: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(10_000 * i + 100 * a + rank)
        return torch.randint(0, margs.vocab_size, (args.batch, args.seq + 1), generator=gen)

    meshes: dict[str, Any] = {}

    def fsdp_mesh(kind: str):
        if kind not in meshes:  # one per kind, built in the same order on every rank
            meshes[kind] = (init_device_mesh("cpu", (n // m, m), mesh_dim_names=("dp_replicate", "dp_shard"))
                            if kind == "fsdp2-hsdp" else init_device_mesh("cpu", (n,), mesh_dim_names=("dp",)))
        return meshes[kind]

    variants = build_variants(args, margs, mesh, fsdp_mesh, batch)

    def run(v: Variant, into: Compiles) -> tuple[float, dict[str, int]]:
        before = local_tx_bytes(["lo", *uplinks]) if rank == 0 and on_emulator else {}
        dist.barrier()
        t = time.perf_counter()
        with watch_compiles(into, v.compile_ids):
            v.losses.append(v.step_fn(v.n, accum))
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        after = local_tx_bytes(["lo", *uplinks]) if rank == 0 and on_emulator else {}
        v.n += 1
        return dt.item(), {k: after[k] - before[k] for k in after}

    t_start = time.perf_counter()
    for v in variants:  # the compiling steps, one variant at a time
        try:
            v.first_s, _ = run(v, v.first)
            failed = torch.zeros(1)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, the rest run
            v.error = f"{type(e).__name__}: {e}".splitlines()[0]
            traceback.print_exc()
            failed = torch.ones(1)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # every rank drops a variant any rank failed
        if failed.item() and not v.error:
            v.error = "failed on another rank"
        if rank == 0:
            print(f"[bench] {label(v.row())}: first step {v.first_s:.1f} s, {v.first.graphs} graphs, "
                  f"{v.first.recompiles} recompiles" + (f"; FAILED {v.error}" if v.error else ""), flush=True)
    t_first = time.perf_counter() - t_start
    ok = [v for v in variants if not v.error]
    for rnd in range(args.warmup + args.rounds):
        for v in ok if rnd % 2 == 0 else ok[::-1]:
            t, sent = run(v, v.later)
            if rnd >= args.warmup:
                v.times.append(t)
                v.sent.append(sent)
    t_rounds = time.perf_counter() - t_start - t_first
    if not args.no_timeline:
        from paro_fsdp.mesh import MeshInfo

        dims = T.group_dims(MeshInfo.from_mesh(mesh).groups, dist.group.WORLD.group_name)
        for kind, fm in meshes.items():
            names = ([fm.get_group(0).group_name] if fm.ndim == 1 else
                     [fm.get_group("dp_replicate").group_name, fm.get_group("dp_shard").group_name])
            dims.update(zip(names, ["global"] if fm.ndim == 1 else ["inter", "intra"]))
        threads = T.gloo_threads(dims)
        for v in ok:
            v.timeline = profiled_step(v, accum, rank, uplinks if rank == 0 else [], rate_bps, threads, dims,
                                       args.out_dir)
    rows = []
    final_loss = torch.tensor([v.losses[-1] if v.losses else 0.0 for v in variants], dtype=torch.float64)
    dist.all_reduce(final_loss)
    for i, v in enumerate(variants):
        row: dict[str, Any] = v.row() | {"label": label(v.row()), "error": v.error, "first_s": v.first_s,
                                         "loss": final_loss[i].item() / n}
        row["compiles"] = {"first_graphs": v.first.graphs, "later_graphs": v.later.graphs,
                           "first_recompiles": v.first.recompiles, "later_recompiles": v.later.recompiles,
                           "fxgraph_cache_hits": v.first.cache_hits + v.later.cache_hits,
                           "fxgraph_cache_misses": v.first.cache_misses + v.later.cache_misses}
        row["reasons"] = v.first.reasons + v.later.reasons
        row["frames"] = {"first": v.first.frames, "later": v.later.frames}
        if v.record is not None:
            import passes

            row["graphs_with_collectives"] = [f"{r.phase}: {passes.summary(r.before)} -> {passes.summary(r.after)} "
                                              f"{r.changes}" for r in v.record.records]
        if not v.error and v.times:
            t = statistics.median(v.times)
            row.update(step_s=t, times=v.times, tokens_per_s=n * accum * args.batch * args.seq / t)
            if on_emulator and rank == 0:
                node = [sum(b for k, b in s.items() if k != "lo") for s in v.sent]
                row["inter_bytes"] = statistics.median(node) / m
                row["intra_bytes"] = statistics.median(s.get("lo", 0) for s in v.sent) / m
                if rate_bps:
                    row["link_util"] = statistics.median(b * 8 / rate_bps / dt for b, dt in zip(node, v.times))
        elif not v.error:
            row["error"] = "no timed rounds (--rounds 0)"
        if v.timeline:
            row["timeline"] = v.timeline
        rows.append(row)
    if rank == 0:
        meta = {"n": n, "m": m, "rate": os.environ.get("PARO_EMU_RATE", "?"), "topology":
                os.environ.get("PARO_EMU_TOPOLOGY", "none"), "params": margs.num_params(), "batch": args.batch,
                "seq": args.seq, "accum": accum, "backend": args.backend, "rounds": args.rounds,
                "model": vars(args) | {}, "first_steps_s": t_first, "rounds_s": t_rounds}
        print(format_table(rows, meta), flush=True)
        print(RESULT_TAG + json.dumps({"meta": meta, "rows": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def profiled_step(v: Variant, accum: int, rank: int, uplinks: list[str], rate_bps: float, threads: dict,
                  dims: dict, out_dir: str) -> dict | None:
    """One step of ``v`` under torch.profiler (every rank), with the uplink counters sampled on
    rank 0; rank 0 draws it and returns the fractions (other ranks: None)."""
    from paro_fsdp.train import timeline as T

    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        sampler = LinkSampler(uplinks, t0) if uplinks else None
        if sampler:
            sampler.start()
        with torch.profiler.record_function(f"ProfilerStep#{v.n}"):
            with watch_compiles(v.later, v.compile_ids):
                v.losses.append(v.step_fn(v.n, accum))
        if sampler:
            sampler.stop.set()
            sampler.join()
    v.n += 1
    if rank != 0:
        return None
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            tl = T.parse(json.load(f), threads, dims)
    finally:
        os.unlink(path)
    if tl is None:
        return None
    frac = T.fractions(tl)
    series = None
    if sampler and len(sampler.samples) > 1:
        mids, mbs, busy = link_series(sampler.samples, rate_bps, duration_ms=tl.duration)
        series, frac["link_busy_fraction"] = (mids, mbs), busy
    png = write_timeline_png(os.path.join(out_dir, f"timeline_{slug(v.row())}.png"), tl.rows, tl.duration, frac,
                             series, rate_bps, label(v.row()))
    return frac | {"duration_ms": tl.duration, "png": png}
