"""Reordering for overlap: issue collectives early, wait for them late.

  * waits sink to just before their first use, so everything in between overlaps the transfer;
  * an all-gather is issued right after the previous block's collectives are issued (one block
    of prefetch): in forward the all-gather of block i+1 runs under block i's compute, in
    backward (activation checkpointing re-gathers) the mirror;
  * a reduce-scatter (or all-reduce) is issued as soon as its input can exist: the cheap ops
    that prepare it (layout copies, the last micro-step's add of the accumulator) move up with
    it. With the hierarchical pass, or on the last micro-step (the boundary's inter reduction),
    the inter part of a block's gradient reduction follows its intra part and its wait moves to
    the end of backward, so it overlaps the rest of backward;
  * the wait for such an intra part (and the inter issue behind it) moves past the next block's
    intra issue, so the intra reduce-scatter runs under the next block's backward too.

Memory bound: prefetching holds block i+1's gathered parameters during block i, so an all-gather
is hoisted only if the gathered bytes already in flight at the new position plus its own stay
within ``max_prefetch_bytes`` (None: no bound; 0: no prefetch at all).
"""
from __future__ import annotations

import torch.fx as fx

from paro_fsdp.collectives import Kind

from .graph import COMPUTE, KIND_OF, WAITS, Collective, GroupTable, collectives, positions


def _cheap(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target not in COMPUTE and n.target not in WAITS and n.target not in KIND_OF


def sink_waits(graph: fx.Graph, groups: GroupTable) -> int:
    """Move each wait, with the cheap ops that consume its result (views, layout copies), to
    just before the first op that does real work with it (a matmul, another collective, the
    graph's output)."""
    moved = 0
    for c in collectives(graph, groups):
        members, tail = {c.wait}, [c.wait]
        target = None
        n = c.wait.next
        while n.op != "output":
            if any(i in members for i in n.all_input_nodes):
                if not _cheap(n):
                    target = n
                    break
                members.add(n)
                tail.append(n)
            n = n.next
        target = target or n
        if tail[-1].next is target:
            continue
        for t in tail:
            target.prepend(t)
        moved += 1
    return moved


def _movable_chain(node: fx.Node, after: int, pos: dict[fx.Node, int], waits: set[fx.Node]) -> list[fx.Node] | None:
    """``node`` and its ancestors placed after position ``after``, if all are cheap (no compute,
    no placeholders; no waits other than ``waits``): what has to move with it."""
    chain, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        if n in seen or pos[n] <= after:
            continue
        seen.add(n)
        if n.op != "call_function" or n.target in COMPUTE or (n.target in WAITS and n not in waits):
            return None
        chain.append(n)
        todo.extend(n.all_input_nodes)
    return sorted(chain, key=lambda n: pos[n])


def _collective_fed_by(wait: fx.Node) -> fx.Node | None:
    """The collective that reads ``wait``'s result through cheap ops (a hierarchical move's
    next phase), or None."""
    todo, seen = list(wait.users), set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or n.target in COMPUTE:
            continue
        seen.add(n)
        if n.target in KIND_OF:
            return n
        if _cheap(n):
            todo.extend(n.users)
    return None


def _last_real_input(node: fx.Node, pos: dict[fx.Node, int]) -> fx.Node:
    """The latest ancestor of ``node`` that cannot move (compute, a wait, a collective, a graph
    input), looking through the cheap ops (copies, views, adds) that prepare its input."""
    best, todo, seen = None, list(node.all_input_nodes), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _cheap(n):
            todo.extend(n.all_input_nodes)
        elif best is None or pos[n] > pos[best]:
            best = n
    return best if best is not None else next(iter(node.graph.nodes))


def _inflight_bytes(graph: fx.Graph, at: int, colls: list[Collective]) -> int:
    pos = positions(graph)
    return sum(c.nbytes for c in colls if c.kind == Kind.ALL_GATHER and pos[c.node] <= at < pos[c.wait])


def hoist_issues(graph: fx.Graph, groups: GroupTable, max_prefetch_bytes: int | None = None) -> int:
    """All-gathers of block b move to just before block b-1's first wait (its compute start);
    when a block's gather has two phases (hierarchical: inter, then intra on the inter result),
    the first phase moves one block further ahead, so both phases overlap compute."""
    moved = 0
    colls = collectives(graph, groups)
    blocks: list[tuple] = []
    for c in colls:
        if c.kind == Kind.ALL_GATHER and c.block not in blocks:
            blocks.append(c.block)
    for c in colls:
        pos = positions(graph)
        own_waits = {p.wait for p in colls if p.block == c.block and p is not c}
        if c.kind == Kind.ALL_GATHER:
            i = blocks.index(c.block)
            # the first (inter) phase of a hierarchical gather goes a block further ahead than
            # its second phase and than a single-phase gather
            ahead = i - 2 if _collective_fed_by(c.wait) is not None else i - 1
            if i == 0 or max_prefetch_bytes == 0:
                continue
            if ahead >= 0:
                # where that block's compute starts: the first wait of its last-phase gathers
                # (a first-phase wait feeds another collective, and may itself have moved early)
                prev = [p for p in colls if p.block == blocks[ahead] and p.kind == Kind.ALL_GATHER
                        and not any(u.target in KIND_OF for u in p.wait.users)]
                if not prev:
                    continue
                anchor = min((p.wait for p in prev), key=lambda n: pos[n]).prev
            else:
                anchor = max(c.node.all_input_nodes, key=lambda n: pos[n])
            if pos[c.node] <= pos[anchor]:
                continue
            if max_prefetch_bytes is not None and \
                    _inflight_bytes(graph, pos[anchor], colls) + c.nbytes > max_prefetch_bytes:
                continue
        else:  # as soon as the input can exist: with the cheap ops that prepare it
            anchor = _last_real_input(c.node, pos)
        chain = _movable_chain(c.node, pos[anchor], pos, own_waits)
        if not chain or pos[chain[0]] <= pos[anchor] + 1:
            continue
        for n in chain:
            anchor.append(n)
            anchor = n
        moved += 1
    return moved


def _later_users_closure(start: fx.Node, until: fx.Node, pos: dict[fx.Node, int]) -> list[fx.Node] | None:
    """``start`` and everything placed before ``until`` that reads it, directly or not: what must
    move with ``start`` to just after ``until``; None when compute is among them."""
    group, todo = {start}, [start]
    while todo:
        for u in todo.pop().users:
            if u in group or pos[u] > pos[until]:
                continue
            if u.op != "call_function" or u.target in COMPUTE:
                return None
            group.add(u)
            todo.append(u)
    return sorted(group, key=lambda n: pos[n])


def _compute_between(graph: fx.Graph, pos: dict[fx.Node, int], first: fx.Node, last: fx.Node) -> int:
    return sum(1 for n in graph.nodes
               if n.op == "call_function" and n.target in COMPUTE and pos[first] < pos[n] < pos[last])


def defer_second_phases(graph: fx.Graph, groups: GroupTable) -> int:
    """A two-phase gradient reduction (intra reduce-scatter, then inter on its result) waits for
    its first phase only once the next block's first phase is issued: the intra reduce-scatter
    of block b then runs under block b-1's backward instead of stalling it, and block b's inter
    phase is queued on the link right behind it. Not where the inter phase would then have no
    compute left to hide under (the last block of backward before the root)."""
    moved = 0
    colls = collectives(graph, groups)
    waits = {c.node: c.wait for c in colls}
    for c in colls:
        second = _collective_fed_by(c.wait) if c.kind != Kind.ALL_GATHER else None
        if second not in waits:
            continue
        pos = positions(graph)
        nxt = next((d for d in colls if d.kind == c.kind and d.dim == c.dim and d.block != c.block
                    and pos[d.node] > pos[c.wait]), None)
        if nxt is None or _compute_between(graph, pos, nxt.node, waits[second]) == 0:
            continue  # no compute would be left for the inter phase to hide under
        group = _later_users_closure(c.wait, nxt.node, pos)
        if group is None:
            continue
        anchor = nxt.node
        for n in group:
            anchor.append(n)
            anchor = n
        moved += 1
    return moved


def reorder_for_overlap(gm: fx.GraphModule, groups: GroupTable, max_prefetch_bytes: int | None = None) -> int:
    """Sink waits, hoist issues, defer second phases of reductions; return how many nodes moved.
    Every rank runs the same pass on the same graph, so collectives keep one order across ranks."""
    moved = (sink_waits(gm.graph, groups) + hoist_issues(gm.graph, groups, max_prefetch_bytes)
             + defer_second_phases(gm.graph, groups))
    gm.graph.lint()
    return moved
