"""Bucketing: one collective per block, phase and mesh dimension, however the trace emitted them.

The engine emits one collective per parameter group, and a block holds one group per strategy
(a per-tensor policy gives several); the same block, phase, kind, process group, dtype and
reduction then form one bucket, merged into a single collective with torch's own bucketing
(``torch._inductor.fx_passes.bucketing``): the inputs are concatenated rank-major and the output
split back, so each consumer sees exactly what it saw before. A collective whose input depends
on another member's result (a two-phase move) is never merged with it.
"""
from __future__ import annotations

from collections import defaultdict

import torch.fx as fx
from torch._inductor.fx_passes.bucketing import merge_all_gather, merge_reduce_scatter
from torch._inductor.pattern_matcher import stable_topological_sort

from paro_fsdp.collectives import Kind

from .graph import Collective, GroupTable, collectives


def _ancestors(node: fx.Node, stop: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(n.all_input_nodes)
    return seen


def plan(graph: fx.Graph, groups: GroupTable) -> list[list[Collective]]:
    """Buckets of two or more collectives that can be merged (graph order kept)."""
    keyed: dict[tuple, list[Collective]] = defaultdict(list)
    for c in collectives(graph, groups):
        if c.kind == Kind.ALL_REDUCE:  # the engine all-reduces only at the boundary, in eager code
            continue
        val = c.node.args[0].meta.get("val")  # type: ignore[union-attr]
        op = c.node.args[1] if c.kind == Kind.REDUCE_SCATTER else None
        keyed[(c.kind, c.group, getattr(val, "dtype", None), op, c.block)].append(c)
    buckets = []
    for members in keyed.values():
        bucket: list[Collective] = []
        for c in members:
            anc = _ancestors(c.node, set())
            if any(b.wait in anc for b in bucket):  # depends on a member: start a new bucket
                if len(bucket) > 1:
                    buckets.append(bucket)
                bucket = []
            bucket.append(c)
        if len(bucket) > 1:
            buckets.append(bucket)
    return buckets


def bucket_collectives(gm: fx.GraphModule, groups: GroupTable) -> int:
    """Merge every bucket of ``plan``; return how many collectives were removed."""
    buckets = plan(gm.graph, groups)
    ag = [[c.node for c in b] for b in buckets if b[0].kind == Kind.ALL_GATHER]
    rs = [[c.node for c in b] for b in buckets if b[0].kind == Kind.REDUCE_SCATTER]
    if ag:
        merge_all_gather(gm, ag)
    if rs:
        merge_reduce_scatter(gm, rs)
    if ag or rs:
        stable_topological_sort(gm.graph)
        gm.graph.lint()
    return sum(len(b) - 1 for b in buckets)
