"""The compile story in one place: graph passes over the engine's collectives, and the one call
that compiles a sharded model.

    import passes
    record = passes.compile_model(model)   # after paro_shard / fully_shard, before the first step
    ...
    print(record.report())                  # each graph's collective schedule before and after

``compile_model`` does, in order (each part switchable):
  1. the graph passes for this model's process groups bound to its compiles (inductor's config
     patch), run after inductor's post-grad passes on every forward and backward graph;
  2. the blocks compiled with their hooks inside their graphs (``paro_fsdp.traced._compile_block``):
     a block's gather and its compute are one graph, the gather recomputed in backward, the last
     micro-step's reduction to the OS level in the backward graph (scope "blocks", as torchtitan
     compiles per block); or the whole model as torch's ``model.compile()`` does (scope "model");
  3. the refresh of the working copies after each optimizer step as one graph
     (``paro_fsdp.traced._compile_push``), whose all-gathers the bucketing pass merges.
Why a call of this package and not the engine's: the engine never imports the passes (they sit
above it). What torch users already write keeps working without it: ``block.compile()`` and
``model.compile()`` on a sharded model compile the engine's way, without passes and with an eager
push. The engine's side of tracing (the autograd Function that gathers and reduces, the gradient
sinks, where the boundary runs) is ``paro_fsdp/traced.py``.

Each pass is a small function of the graph, registered here by name and switchable one by one
(from Python here, from the trainer's ``[compile] passes``). They run in the fixed order of
``ORDER`` (bucket first; reorder last, on the final set of collectives). There is no pass that
makes global collectives hierarchical: the engine's one PaRO-CC call (``paro_fsdp.paro_cc``)
decides how each runs, and the traced code emits its intra and inter phases as the eager engine
issues them. The installed object is an inductor ``CustomGraphPass`` whose uuid hashes the
pass names, options and this package's source, so the FX-graph cache never replays a graph made
with other passes (custom passes are skipped on cache hits).
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from paro_fsdp.mesh import MeshGroups
from paro_fsdp._compat import isolate_compile_cache
from paro_fsdp.traced import _compile_block, _compile_push

from .bucketing import bucket_collectives
from .graph import GroupTable, collectives, group_table, phase_of
from .reorder import reorder_for_overlap
from .schedule import Event, as_dicts, render_png, render_text, schedule, schedule_of_code, summary
from .scope import peak_memory

ORDER = ("bucketing", "reorder")
#: passes that no longer exist, and why: named in the error a config naming them gets
REMOVED = {"hierarchical": "global collectives are PaRO-CC in compiled graphs without a pass (the engine decides, "
                           "as in eager runs); drop it from the list"}


@dataclass
class PassOptions:
    max_prefetch_bytes: int | None = None  # reorder: bound on gathered bytes in flight (None: none)
    dump_dir: str | None = None  # write each graph's schedule (text, JSON, PNG) here


def _passes(opts: PassOptions, groups: GroupTable) -> dict[str, Callable[[fx.GraphModule], int]]:
    return {
        "bucketing": lambda gm: bucket_collectives(gm, groups),
        "reorder": lambda gm: reorder_for_overlap(gm, groups, opts.max_prefetch_bytes),
    }


@dataclass
class GraphRecord:
    phase: str
    before: list[Event]
    after: list[Event]
    changes: dict[str, int] = field(default_factory=dict)  # pass -> what it did (merged / rewritten / moved)


class ParoPasses(CustomGraphPass):
    """The passes inductor (or ``aot_backend``) runs on each graph. ``meshes``: the
    ``MeshGroups`` of the models it compiles (``model.paro_mesh_groups()``; ``add_mesh`` for a
    model built later): a graph names its process groups only, and this is how a pass knows
    which mesh dimension each one is."""

    def __init__(self, names: Iterable[str] = ORDER, options: PassOptions | None = None,
                 meshes: Iterable[MeshGroups] = ()) -> None:
        names = list(names)
        removed = [f"{n!r}: {REMOVED[n]}" for n in names if n in REMOVED]
        if removed:
            raise ValueError(f"graph pass {'; '.join(removed)}")
        unknown = [n for n in names if n not in ORDER]
        if unknown:
            raise ValueError(f"unknown graph pass(es) {unknown}; valid: {list(ORDER)}")
        self.names = [n for n in ORDER if n in names]
        self.options = options or PassOptions()
        self.records: list[GraphRecord] = []
        self.groups: dict[str, tuple[str, MeshGroups]] = group_table(*meshes)

    def add_mesh(self, mesh: MeshGroups) -> None:
        self.groups.update(group_table(mesh))

    def __call__(self, graph: fx.Graph) -> None:
        """Inductor's entry, on every graph it compiles: the passes, and inductor's
        ``reorder_for_peak_memory`` off for this graph if it is the engine's (``passes.scope``)."""
        engine = self.run(graph)
        if "reorder" in self.names:
            peak_memory.graph(engine)

    def run(self, graph: fx.Graph) -> bool:
        """Run the passes on ``graph`` if it is an engine graph (it has a collective of a group of
        ``meshes``); return whether it was."""
        if not any(c.info is not None for c in collectives(graph, self.groups)):
            return False
        gm = graph.owning_module
        record = GraphRecord(phase_of(graph), schedule(graph, self.groups), [])
        fns = _passes(self.options, self.groups)
        for name in self.names:
            record.changes[name] = fns[name](gm)
        record.after = schedule(graph, self.groups)
        self.records.append(record)
        if self.options.dump_dir:
            self._dump(record, len(self.records) - 1)
        return True

    def _dump(self, r: GraphRecord, index: int) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        base = os.path.join(self.options.dump_dir, f"rank{rank}_graph{index}_{r.phase}")
        os.makedirs(self.options.dump_dir, exist_ok=True)
        with open(base + ".txt", "w") as f:
            f.write(self.report_one(r) + "\n")
        with open(base + ".json", "w") as f:
            json.dump({"phase": r.phase, "passes": self.names, "changes": r.changes,
                       "before": as_dicts(r.before), "after": as_dicts(r.after)}, f, indent=1)
        render_png(r.before, r.after, base + ".png", f"{r.phase} graph {index}: passes {self.names}")

    def report_one(self, r: GraphRecord) -> str:
        return "\n".join([render_text(r.before, f"{r.phase}, before passes"),
                          render_text(r.after, f"{r.phase}, after {self.names} {r.changes}")])

    def report(self) -> str:
        return "\n\n".join(self.report_one(r) for r in self.records)

    def inductor_options(self) -> dict:
        """Inductor settings that run these passes: for ``torch.compile(options=...)``, or set
        process-wide by ``install``. No ``reorder_for_peak_memory``: it moved every prefetched
        all-gather back to just before its use (tests/test_compile.py reads the generated code),
        and the pass itself turns it off for the engine's graphs only (``passes.scope``)."""
        return {"post_grad_custom_post_pass": self}

    def uuid(self) -> bytes:
        files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.py")))
        key = json.dumps([self.names, vars(self.options)], sort_keys=True, default=str).encode()
        return get_hash_for_files(tuple(files), extra=key.decode())


def install(names: Iterable[str] = ORDER, options: PassOptions | None = None, meshes: Iterable[MeshGroups] = (),
            **kw) -> ParoPasses:
    """Register the passes with inductor (replacing any earlier ``install``) for the models of
    ``meshes``; return the object that records what they did. ``install([])`` keeps the
    recording and runs no pass. Inductor's other settings are left as they are: graphs without
    the engine's collectives compile as they would without the passes."""
    p = ParoPasses(names, options or PassOptions(**kw), meshes)
    uninstall()
    torch._inductor.config.post_grad_custom_post_pass = p
    return p


def compile_for(model, compile_cfg, dump_folder: str) -> ParoPasses | None:
    """The trainer's ``[compile]`` section applied to ``model`` by ``compile_model``:
    ``compile_cfg`` has the trainer's ``passes``, ``backend``, ``scope``, ``push_graph``,
    ``dump_schedule`` and ``max_prefetch_mb`` fields."""
    c = compile_cfg
    dump = os.path.join(dump_folder, "compile") if c.dump_schedule else None
    bound = None if c.max_prefetch_mb < 0 else int(c.max_prefetch_mb * 2**20)
    full = {"fullgraph": True} if c.scope == "blocks" else {}
    return compile_model(model, c.passes, scope=c.scope, push=c.push_graph,
                         pass_options=PassOptions(max_prefetch_bytes=bound, dump_dir=dump), backend=c.backend, **full)


def aot_backend(p: ParoPasses):
    """A torch.compile backend that runs the passes on AOTAutograd's forward and backward graphs
    and executes them as they are (no inductor codegen): seconds instead of minutes to see and
    check what the passes do, with the same graphs' collectives and numerics. It splits forward
    from backward with inductor's partitioner (min-cut): AOTAutograd's default one saves every
    view of a gathered weight that backward reads, so it would keep whole parameters alive that
    inductor recomputes (with two groups per block, one group's gather was never recomputed)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm: fx.GraphModule, example_inputs):
        p.run(gm.graph)
        gm.recompile()
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)


def uninstall() -> None:
    """Undo ``install``: no custom pass (and ``reorder_for_peak_memory`` as the user set it)."""
    torch._inductor.config.post_grad_custom_post_pass = None
    peak_memory.end()


SCOPES = ("blocks", "model")


def compile_model(model: nn.Module, passes: Iterable[str] = ORDER, *, scope: str = "blocks", push: bool = False,
                  pass_options: PassOptions | None = None, **compile_kwargs: Any) -> ParoPasses | None:
    """Compile a sharded ``model`` for training; return the passes' record (None for a backend
    other than inductor or "aot", whose graphs never reach the passes). ``compile_kwargs`` go to
    ``torch.compile`` (``backend``, ``fullgraph``, ``options``, ...). The passes are bound to this
    model's compiles (inductor's config patch, ``options``), not installed process-wide, so other
    models compile as they would without them. Backend "aot" runs them on AOTAutograd's graphs
    without inductor codegen (seconds, not minutes). ``push``: the refresh of the working copies
    after each optimizer step as one graph too (off by default, as in the trainer: it saves a few
    collective launches once per step and costs more first-step compile than a block; the eager
    refresh overlaps the next forward). A block that checkpoints its whole call
    (``checkpoint_in_graph`` attribute, as the trainer's) checkpoints inside its graph instead."""
    state = getattr(model, "_paro_state", None)
    if state is None:
        raise ValueError("compile_model needs a model returned by paro_shard or fully_shard; shard it first")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    backend, record = compile_kwargs.get("backend", "inductor"), None
    if backend in ("aot", "inductor"):  # with no pass named, the record still has each graph's schedule
        record = ParoPasses(passes, pass_options, meshes=[model.paro_mesh_groups()])
    if backend == "aot":
        compile_kwargs["backend"] = aot_backend(record)
    elif backend == "inductor":
        compile_kwargs["options"] = {**compile_kwargs.get("options", {}), **record.inductor_options()}
    if dist.is_initialized():
        isolate_compile_cache(dist.get_rank())
    blocks = [b.module for b in state.blocks if not b.is_root]
    if any(hasattr(b, "checkpoint_in_graph") for b in blocks):
        # the block hooks swap module parameters (a side effect): in a checkpointed block dynamo
        # must not replay it in the recomputation, which the compiled graph does by itself
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if scope == "model":
        model.compile(**compile_kwargs)
    else:
        for block in blocks:
            checkpointed = hasattr(block, "checkpoint_in_graph")
            if checkpointed:
                block.checkpoint_in_graph = True
            _compile_block(block, checkpointed=checkpointed, **compile_kwargs)
    if push:  # a loop over the groups' generators: not one full graph
        _compile_push(model, **{k: v for k, v in compile_kwargs.items() if k != "fullgraph"})
    return record


__all__ = ["ORDER", "SCOPES", "compile_model", "PassOptions", "ParoPasses", "aot_backend", "compile_for", "install",
           "uninstall", "schedule", "schedule_of_code", "summary"]
