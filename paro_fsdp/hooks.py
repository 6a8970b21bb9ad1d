"""The autograd Functions through which the engine sees forward and backward.

``Unshard`` hands a block its whole parameters (the collectives already ran) and, in backward,
receives their gradients in one call: the natural place to reduce a block's gradients as one
bucket. ``OnBackward`` is an identity whose backward calls back into the engine: on a block's
outputs it fires just before the block's backward, on its inputs just after.
Both are plain autograd Functions, which dynamo/AOTAutograd can trace.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from .state import ParoBlock


class Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: "ParoBlock", group_index: int, *sharded: torch.Tensor):  # type: ignore[override]
        ctx.block, ctx.group_index = block, group_index
        return tuple(p.view_as(p) for p in block.groups[group_index].full_params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.block.post_backward(ctx.group_index, list(grads))
        return (None, None) + (None,) * len(grads)


class OnBackward(torch.autograd.Function):
    """Identity on some tensors whose backward calls ``callback`` once the gradients of all of
    them are ready. On a block's outputs: just before the block's own backward (re-gather its
    parameters, prefetch the next). On its inputs: once the block's backward has produced the
    input gradients (free fully frozen groups, which get no ``Unshard`` backward of their own)."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.callback()
        return (None,) + grads


def _route(callback: Callable[[], None], tree: Any) -> Any:
    """Pass the tensors of ``tree`` that need a gradient through one ``OnBackward``."""
    leaves, spec = tree_flatten(tree)
    idx = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
    if not idx:
        return tree
    wrapped = OnBackward.apply(callback, *[leaves[i] for i in idx])
    for i, w in zip(idx, wrapped):
        leaves[i] = w
    return tree_unflatten(leaves, spec)


def register_post_backward(block: "ParoBlock", args: Any, kwargs: Any) -> tuple[Any, Any]:
    return _route(block.post_backward_frozen, (args, kwargs))


def register_pre_backward(block: "ParoBlock", output: Any) -> Any:
    return _route(block.pre_backward, output)
