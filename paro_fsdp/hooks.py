"""The autograd Functions through which the engine sees forward and backward.

``Unshard`` hands a block its whole parameters (the collectives already ran) and, in backward,
receives their gradients in one call: the natural place to reduce a block's gradients as one
bucket. ``PreBackward`` is an identity on a block's outputs whose backward fires just before
the block's own backward: the place to re-gather its parameters and prefetch the next block.
Both are plain autograd Functions, which dynamo/AOTAutograd can trace.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


class PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: "ParoBlock", *outputs: torch.Tensor):  # type: ignore[override]
        ctx.block = block
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.block.pre_backward()
        return (None,) + grads


class PostBackward(torch.autograd.Function):
    """Identity on a block's inputs; its backward fires once the block's backward has produced
    the input gradients: the point where a frozen group (no gradient of its own, so no
    ``Unshard`` backward) can be freed."""

    @staticmethod
    def forward(ctx, block: "ParoBlock", *inputs: torch.Tensor):  # type: ignore[override]
        ctx.block = block
        return tuple(i.view_as(i) for i in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.block.post_backward_frozen()
        return (None,) + grads


def _route(fn: type[torch.autograd.Function], block: "ParoBlock", tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    idx = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
    if not idx:
        return tree
    wrapped = fn.apply(block, *[leaves[i] for i in idx])
    for i, w in zip(idx, wrapped):
        leaves[i] = w
    return tree_unflatten(leaves, spec)


def register_post_backward(block: "ParoBlock", args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Route the block's tensor inputs that need a gradient through ``PostBackward``."""
    return _route(PostBackward, block, (args, kwargs))


def register_pre_backward(block: "ParoBlock", output: Any) -> Any:
    """Route the block's tensor outputs that need a gradient through ``PreBackward``."""
    return _route(PreBackward, block, output)
