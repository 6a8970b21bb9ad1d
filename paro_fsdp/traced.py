"""What a block does while torch.compile traces it: every collective becomes a graph node.

Why a second path: the eager engine keeps collectives in flight across hooks, frees storage with
``resize_`` and calls back into Python from backward, none of which a graph captures; built from
the eager path's own moves, eager and compiled runs move the same bytes.
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .boundary import push_params, reduce_to_os, run, set_master_grads
from .param_group import GradState
from .strategy import Level

if TYPE_CHECKING:
    from .param_group import ParoParamGroup


def gather_whole(group: "ParoParamGroup") -> list[torch.Tensor]:
    """The group's whole tensors, one copy per tensor (few, large ops keep compile time low)."""
    gathered = group.gather_params().wait()
    out = []
    for t, ref in zip(group.p_layout.tensors, group.refs):
        numel, shape = ref.like.numel(), ref.like.shape  # static to dynamo (ParamRef.of)
        out.append(group.whole_rows(gathered, t).reshape(-1)[:numel].view(shape))
    return out


def reduce_to_g(group: "ParoParamGroup", grads: list[torch.Tensor | None]) -> torch.Tensor:
    """This micro-step's G-level gradient (for G = N the FULL buffer itself)."""
    buf = group.grad_buffer(grads)
    pending = group.reduce_grad_buffer(buf)
    return buf if pending is None else pending.wait()


class GatherForCompute(torch.autograd.Function):
    """P level -> whole tensors in forward; whole-tensor gradients -> G level in backward."""

    @staticmethod
    def forward(ctx, group: "ParoParamGroup", sink: torch.Tensor | None, acc: torch.Tensor | None,  # type: ignore[override]
                last: bool, *p: torch.Tensor):
        """``last``: reduce to the OS level in backward (``sink`` is then ``group.os_sink``),
        adding ``acc``, the G-level sum of the earlier micro-steps."""
        ctx.group, ctx.n, ctx.last = group, len(p), last
        ctx.save_for_backward(acc)
        if group.plan.params_whole:
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
            run(reduce_to_os(group, reduced if acc is None else acc + reduced, out))
            reduced = out[0]
        return (None, reduced, None, None) + (None,) * ctx.n


def _recompute_gathers(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Every op of the gather is recomputed in backward rather than saved."""
    return CheckpointPolicy.MUST_RECOMPUTE


def _gather(group: "ParoParamGroup", sink: torch.Tensor | None, acc: torch.Tensor | None, last: bool,
            *p: torch.Tensor) -> list[torch.Tensor]:
    return list(GatherForCompute.apply(group, sink, acc, last, *p))


def unshard(group: "ParoParamGroup") -> list[torch.Tensor]:
    """The whole tensors, differentiable into ``group.sink``. With ``reshard_after_forward`` the
    gather is MUST_RECOMPUTE, so backward re-gathers instead of keeping whole tensors alive."""
    p = group.p_locals if group.plan.params_whole else [group.master_flat if group.casts_p else group.p_flat]
    if not group.trainable or not torch.is_grad_enabled():
        with torch.no_grad():
            return _gather(group, None, None, False, *p)
    if group.sink is None:
        raise RuntimeError(f"{group.name}: torch.compile started without making this group's gradient sinks: "
                           "torch._dynamo.reset() after paro_shard drops the callback that makes them; "
                           "reset before paro_shard")
    last = group.last_backward
    args = (group, group.os_sink, group.grad_acc.tensor, True) if last else (group, group.sink, None, False)
    if group.reshard_after_forward:
        return checkpoint(_gather, *args, *p, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, _recompute_gathers))
    return _gather(*args, *p)


def _call_with_hooks(block: nn.Module, *args, **kwargs):
    return block._call_impl(*args, **kwargs)


def _checkpointed_call_with_hooks(block: nn.Module, *args, **kwargs):
    return checkpoint(block._call_impl, *args, use_reentrant=False, **kwargs)


def _compile_block(block: nn.Module, checkpointed: bool = False, **compile_kwargs) -> None:
    """``block.compile(**compile_kwargs)`` with the block's hooks in its graph (``ParoModule.compile``).
    ``checkpointed``: the whole call under activation checkpointing inside that graph, so backward
    gathers once for the recomputation (an eager checkpoint around it would gather twice)."""
    call = _checkpointed_call_with_hooks if checkpointed else _call_with_hooks
    block._compiled_call_impl = torch.compile(partial(call, block), **compile_kwargs)


def _leaf(group: "ParoParamGroup", level: Level) -> torch.Tensor:
    """A gradient leaf of the level's buffer length that holds no memory."""
    n = group.t_layout.numel(level)
    return torch.zeros((), dtype=group.mp.grad_dtype, device=group.device).expand(n).requires_grad_()


def make_sinks(group: "ParoParamGroup") -> None:
    """``group.sink`` (G level, each micro-step) and ``group.os_sink`` (OS level, the last one)."""
    if not group.trainable:
        return

    def hand_over(leaf: torch.Tensor) -> None:
        group.grad_acc.add(leaf.grad)
        leaf.grad = None
        group.grads = GradState.AT_G

    def hand_to_masters(leaf: torch.Tensor) -> None:
        set_master_grads(group, leaf.grad)
        leaf.grad = None

    group.sink, group.os_sink = _leaf(group, group.strategy.g), _leaf(group, group.strategy.os)
    group.sink.register_post_accumulate_grad_hook(hand_over)
    group.os_sink.register_post_accumulate_grad_hook(hand_to_masters)


# Groups whose sinks are made when torch.compile next starts: at paro_shard, eager-only runs would
# hold unused leaves; while tracing, a leaf made inside a traced frame breaks the graph.
_awaiting_sinks: "weakref.WeakSet[ParoParamGroup]" = weakref.WeakSet()


def _make_awaited_sinks(_args: object = None) -> None:
    while _awaiting_sinks:
        group = _awaiting_sinks.pop()
        if group.sink is None:
            make_sinks(group)


def make_sinks_on_compile(groups: Iterable["ParoParamGroup"]) -> None:
    """Make the trainable ``groups``' sinks when torch.compile next starts tracing a frame."""
    _awaiting_sinks.update(g for g in groups if g.trainable)
    handler = torch._dynamo.callback.callback_handler
    if _make_awaited_sinks not in handler.start_callbacks:  # torch._dynamo.reset() clears them
        handler.register_start_callback(_make_awaited_sinks)


def _push_each(groups: list["ParoParamGroup"]) -> None:
    """Each group's push in turn, every collective waited as issued (the passes decide what overlaps)."""
    for g in groups:
        run(push_params(g))


def _compile_push(model: nn.Module, **compile_kwargs) -> None:
    """The pushes after each optimizer step as one compiled graph, whose collectives the passes merge
    and schedule (they then no longer wait for the next forward)."""
    model._paro_state.compiled_push = torch.compile(_push_each, **compile_kwargs)
