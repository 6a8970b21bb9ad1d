"""PaRO-CC in the graph: each collective over the flattened (global) group becomes its intra and
inter parts, chunked so the intra part of one chunk overlaps the inter part of the next
(spec section 4).

The replacement is ``paro_fsdp.paro_cc.ParoCC`` itself, traced with make_fx and spliced in where
the global collective stood (the same code the eager engine runs, in flat rank order, so the
values every consumer reads are unchanged). Why: a flat ring over n ranks sends (n-1)/n of the
data across the slow links out of each group; the hierarchy sends (g-1)/g between groups, spread
over m rings at once, and the rest inside groups.
"""
from __future__ import annotations

import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort

from paro_fsdp.comm import MeshComm
from paro_fsdp.paro_cc import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, ParoCC

from .graph import GroupTable, collectives, splice


def _replacement(c, chunk_bytes: int, max_chunks: int):
    cc = ParoCC(MeshComm(c.info), chunk_bytes=chunk_bytes, max_chunks=max_chunks)  # c.info: the MeshGroups
    if c.kind == "all_gather":
        return lambda x: [cc.all_gather(x, order="flat").wait()]
    if c.kind == "reduce_scatter":
        op = c.node.args[1]
        return lambda x: [cc.reduce_scatter(x, op=op, order="flat").wait()]
    op = c.node.args[1]
    return lambda x: [cc.all_reduce(x, op=op).wait()]


def hierarchical_collectives(gm: fx.GraphModule, groups: GroupTable, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                             max_chunks: int = DEFAULT_MAX_CHUNKS) -> int:
    """Rewrite every global collective whose mesh has both levels; return how many."""
    done = 0
    for c in collectives(gm.graph, groups):
        if c.dim != "global" or c.info is None or c.info.g == 1 or c.info.m == 1:
            continue
        x = c.node.args[0]
        splice(gm.graph, _replacement(c, chunk_bytes, max_chunks), [x], c.wait.next, [c.wait], c.node)  # type: ignore[list-item]
        gm.graph.erase_node(c.wait)
        gm.graph.erase_node(c.node)
        done += 1
    if done:
        stable_topological_sort(gm.graph)
        gm.graph.lint()
    return done
