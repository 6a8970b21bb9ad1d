"""What a block does while torch.compile traces it: every collective becomes a graph node.

Why a second path: the eager engine overlaps by keeping collectives in flight across hooks, frees
storage with ``resize_`` and calls back into Python from backward; none of that can be captured
in a graph. While tracing, a group's unshard is one autograd Function instead: its forward
all-gathers the P-level shard into whole tensors, its backward reduces the whole-tensor gradients
to the G level. Both use the same ``MeshComm`` calls as the eager path (one implementation per
collective). The G-level gradient is returned for ``group.sink``, a leaf that holds no memory
(a zero-dim tensor expanded to the G buffer's length): autograd's AccumulateGrad sums it across
micro-steps and a hook hands it to the group's accumulator, the one the eager path fills, so the
accumulation boundary and the optimizer are shared.

Global (P = G or G = G) collectives are issued over the flattened mesh, in flat rank order
(rank k * m + l), and the nested layout of the spec is a local transpose around them. That is the
form the graph passes expect: ``passes.hierarchical`` rewrites each global collective into its
intra and inter parts (PaRO-CC, spec section 4); without it the global ring runs as is.
Ordering, bucketing and overlap are the passes' job, not this module's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .strategy import Level

if TYPE_CHECKING:
    from .param_group import ParoParamGroup


def gather_full(group: "ParoParamGroup") -> torch.Tensor:
    """The group's FULL buffer [m * sum_i] (whole tensors, padded, rank-major), from P = I or G."""
    layout, info, comm = group.p_layout, group.info, group.comm
    if group.strategy.p == Level.I:
        return comm.all_gather(group.p_flat, "intra").wait()
    gathered = comm.all_gather(group.p_flat, "global").wait()  # [k][l][sum_g], flat rank order
    nested = gathered.view(info.g, info.m, layout.sum_g)
    full = torch.empty(info.m, layout.sum_i, dtype=gathered.dtype, device=gathered.device)
    for l in range(info.m):  # noqa: E741 - row l of FULL is intra shard l: its g global shards
        layout.inter_to_i(nested[:, l].reshape(-1), full[l])
    return full.view(-1)


def whole_tensors(group: "ParoParamGroup", full: torch.Tensor) -> list[torch.Tensor]:
    layout, m = group.p_layout, group.info.m
    rows = full.view(m, layout.sum_i)
    return [rows[:, t.off_i : t.off_i + t.size_i].reshape(-1)[: ref.param.numel()].view(ref.param.shape)
            for t, ref in zip(layout.tensors, group.refs)]


def reduce_to_g(group: "ParoParamGroup", grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Sum the whole-tensor gradients over the ranks that share the G-level shard, laid out as
    the group's G buffer (FULL for G = N)."""
    layout, info, comm, dt = group.t_layout, group.info, group.comm, group.mp.grad_dtype
    full = torch.zeros(layout.numel(Level.N), dtype=dt, device=group.device)
    for t, grad in zip(layout.tensors, grads):
        if grad is not None:
            layout.copy_in(full, t, grad.to(dt))
    G = group.strategy.g
    if G == Level.N:
        return full
    if G == Level.I:
        return comm.reduce_scatter(full, "intra").wait()
    rows = full.view(info.m, layout.sum_i)
    nested = torch.empty(info.m, info.g, layout.sum_g, dtype=dt, device=group.device)
    for l in range(info.m):  # noqa: E741
        layout.i_to_inter(rows[l], nested[l].view(-1))
    flat_order = nested.transpose(0, 1).contiguous().view(-1)  # block k * m + l = nested[l][k]
    return comm.reduce_scatter(flat_order, "global").wait()


class GatherForCompute(torch.autograd.Function):
    """P level -> whole tensors in forward; whole-tensor gradients -> G level in backward."""

    @staticmethod
    def forward(ctx, group: "ParoParamGroup", sink: torch.Tensor | None, *p: torch.Tensor):  # type: ignore[override]
        ctx.group, ctx.n = group, len(p)
        if group.strategy.p == Level.N:
            return tuple(t.view_as(t) for t in p)
        return tuple(whole_tensors(group, gather_full(group)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        group = ctx.group
        g = reduce_to_g(group, list(grads[: len(group.trainable)])) if group.trainable else None
        return (None, g) + (None,) * ctx.n


def unshard(group: "ParoParamGroup") -> list[torch.Tensor]:
    """The whole tensors the block computes with, differentiable into ``group.sink``."""
    p = group.p_locals if group.strategy.p == Level.N else [group.p_flat]
    if not group.trainable or not torch.is_grad_enabled():
        with torch.no_grad():
            return list(GatherForCompute.apply(group, None, *p))
    return list(GatherForCompute.apply(group, group.sink, *p))


def make_sink(group: "ParoParamGroup") -> torch.Tensor | None:
    """A leaf of the G buffer's length that holds no memory; see the module docstring."""
    if not group.trainable:
        return None
    n = group.t_layout.numel(group.strategy.g)
    sink = torch.zeros((), dtype=group.mp.grad_dtype, device=group.device).expand(n).requires_grad_()

    def hand_over(leaf: torch.Tensor) -> None:
        if group.grad_acc is None:
            group.grad_acc = leaf.grad
        else:
            group.grad_acc.add_(leaf.grad)
        leaf.grad = None
        group.has_grads = True

    sink.register_post_accumulate_grad_hook(hand_over)
    return sink
