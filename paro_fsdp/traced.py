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

The last micro-step (``model.set_is_last_backward(True)``) goes one step further: its backward
adds the accumulator of the earlier micro-steps to this one's G-level gradient and runs the
boundary's reduction to the OS level (``ParoParamGroup.reduce_to_os``, the optimizer's own code)
inside the graph, returning the result for ``group.os_sink``, whose hook sets the master
gradients. So the inter-group reduction of a block is a graph node right after its intra one, and
the reorder pass overlaps it with the rest of backward; the optimizer skips groups done this way.

Global (P = G or G = G) collectives are issued over the flattened mesh, in flat rank order
(rank k * m + l), and the nested layout of the spec is a local transpose around them. That is the
form the graph passes expect: ``passes.hierarchical`` rewrites each global collective into its
intra and inter parts (PaRO-CC, spec section 4); without it the global ring runs as is.
Ordering, bucketing and overlap are the passes' job, not this module's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ._compat import isolate_compile_cache  # noqa: F401 - callers compiling the engine import it from here
from .param_group import run
from .strategy import Level

if TYPE_CHECKING:
    from .param_group import ParoParamGroup


def _whole(rows: torch.Tensor, numel: int, shape: torch.Size) -> torch.Tensor:
    return rows.reshape(-1)[:numel].view(shape)


def gather_whole(group: "ParoParamGroup") -> list[torch.Tensor]:
    """The group's whole tensors, gathered from P = I (one intra all-gather) or P = G (one
    global all-gather). One slice-and-copy per tensor: few, large ops keep compile time low."""
    layout, info, comm = group.p_layout, group.info, group.comm
    shapes = [(ref.like.numel(), ref.like.shape) for ref in group.refs]  # static to dynamo (ParamRef.of)
    if group.strategy.p == Level.I:
        rows = comm.all_gather(group.p_flat, "intra").wait().view(info.m, layout.sum_i)
        return [_whole(rows[:, t.off_i : t.off_i + t.size_i], *s) for t, s in zip(layout.tensors, shapes)]
    gathered = comm.all_gather(group.p_flat, "global").wait()  # [k][l][sum_g], flat rank order
    if layout.nested_uniform:  # intra shard l of a tensor = its g global shards [k][l] in k order
        blocks = gathered.view(info.g, info.m, layout.sum_g).transpose(0, 1)
        return [_whole(blocks[:, :, t.off_g : t.off_g + t.size_g], *s) for t, s in zip(layout.tensors, shapes)]
    nested = gathered.view(info.g, info.m, layout.sum_g).transpose(0, 1).contiguous()  # [l][k][sum_g]
    full = layout.nested_to_full(nested, torch.zeros(info.m, layout.sum_i, dtype=gathered.dtype, device=gathered.device))
    return [_whole(full[:, t.off_i : t.off_i + t.size_i], *s) for t, s in zip(layout.tensors, shapes)]


def reduce_to_g(group: "ParoParamGroup", grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Sum the whole-tensor gradients over the ranks that share the G-level shard, laid out as
    the group's G buffer (FULL for G = N). The FULL buffer is one ``cat`` of padded gradients."""
    layout, info, comm, dt = group.t_layout, group.info, group.comm, group.mp.grad_dtype
    G, m, g = group.strategy.g, info.m, info.g  # g: the number of groups, as in MeshInfo
    nested = G == Level.G and layout.nested_uniform
    parts = []
    for t, grad in zip(layout.tensors, grads):
        x = grad.to(dt).reshape(t.d0, t.row) if grad is not None else \
            torch.zeros(t.d0, t.row, dtype=dt, device=group.device)
        if t.d0 != m * t.c:
            x = torch.nn.functional.pad(x, (0, 0, 0, m * t.c - t.d0))
        parts.append(x.view(m, g, t.size_g) if nested else x.view(m, t.size_i))
    if nested:  # block k * m + l of the flat order = sub-shard k of intra shard l
        return comm.reduce_scatter(torch.cat(parts, dim=2).transpose(0, 1).reshape(-1), "global").wait()
    full = torch.cat(parts, dim=1)
    if G == Level.N:
        return full.view(-1)
    if G == Level.I:
        return comm.reduce_scatter(full.view(-1), "intra").wait()
    inter = layout.full_to_nested(full, torch.zeros(m, g, layout.sum_g, dtype=dt, device=group.device))
    return comm.reduce_scatter(inter.transpose(0, 1).reshape(-1), "global").wait()


class GatherForCompute(torch.autograd.Function):
    """P level -> whole tensors in forward; whole-tensor gradients -> G level in backward."""

    @staticmethod
    def forward(ctx, group: "ParoParamGroup", sink: torch.Tensor | None, acc: torch.Tensor | None,  # type: ignore[override]
                last: bool, *p: torch.Tensor):
        """``last``: reduce to the OS level in backward (``sink`` is then ``group.os_sink``),
        adding ``acc``, the G-level sum of the earlier micro-steps."""
        ctx.group, ctx.n, ctx.last = group, len(p), last
        ctx.save_for_backward(acc)
        if group.strategy.p == Level.N:
            return tuple(t.view_as(t) for t in p)
        return tuple(gather_whole(group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        group = ctx.group
        # the sink's gradient: this micro-step's at the G level, or (last) the sum at the OS level
        reduced = reduce_to_g(group, list(grads[: len(group.trainable)])) if group.trainable else None
        if ctx.last and reduced is not None:
            (acc,) = ctx.saved_tensors
            out: list[torch.Tensor] = []
            run(group.reduce_to_os(reduced if acc is None else acc + reduced, out))
            reduced = out[0]
        return (None, reduced, None, None) + (None,) * ctx.n


def _recompute_gathers(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Free gathered parameters after forward: every op of the gather (the all-gather and the
    copies into whole tensors) is recomputed in backward rather than saved."""
    return CheckpointPolicy.MUST_RECOMPUTE


def _gather(group: "ParoParamGroup", sink: torch.Tensor | None, acc: torch.Tensor | None, last: bool,
            *p: torch.Tensor) -> list[torch.Tensor]:
    return list(GatherForCompute.apply(group, sink, acc, last, *p))


def unshard(group: "ParoParamGroup") -> list[torch.Tensor]:
    """The whole tensors the block computes with, differentiable into ``group.sink``. With
    ``reshard_after_forward`` (P = I or G), the gather runs under a selective-checkpoint policy
    that makes the compiler recompute it in backward rather than keep whole tensors alive (as
    the eager engine frees and re-gathers them)."""
    p = group.p_locals if group.strategy.p == Level.N else [group.p_flat]
    if not group.trainable or not torch.is_grad_enabled():
        with torch.no_grad():
            return _gather(group, None, None, False, *p)
    last = group.last_backward
    args = (group, group.os_sink, group.grad_acc.tensor, True) if last else (group, group.sink, None, False)
    if group.reshard_after_forward:
        return checkpoint(_gather, *args, *p, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, _recompute_gathers))
    return _gather(*args, *p)


def _leaf(group: "ParoParamGroup", level: Level) -> torch.Tensor:
    """A gradient leaf of the level's buffer length that holds no memory."""
    n = group.t_layout.numel(level)
    return torch.zeros((), dtype=group.mp.grad_dtype, device=group.device).expand(n).requires_grad_()


def make_sinks(group: "ParoParamGroup") -> None:
    """``group.sink`` (G level, each micro-step) and ``group.os_sink`` (OS level, the last
    micro-step); see the module docstring."""
    if not group.trainable:
        return

    def hand_over(leaf: torch.Tensor) -> None:
        group.grad_acc.add(leaf.grad)
        leaf.grad = None
        group.has_grads = True

    def set_master_grads(leaf: torch.Tensor) -> None:
        group.set_master_grads(leaf.grad)
        leaf.grad = None
        group.has_grads = True

    group.sink, group.os_sink = _leaf(group, group.strategy.g), _leaf(group, group.strategy.os)
    group.sink.register_post_accumulate_grad_hook(hand_over)
    group.os_sink.register_post_accumulate_grad_hook(set_master_grads)
