"""The autograd Functions through which the engine sees forward and backward.

Why autograd Functions: ``Unshard``'s backward receives a block's gradients in one call, one
bucket to reduce, and dynamo / AOTAutograd can trace them. They know nothing of blocks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recomputation inside it too)."""
    return torch._C._current_graph_task_id() != -1


class Unshard(torch.autograd.Function):
    """Hands out a group's whole tensors (``full``, already gathered) in place of its sharded
    parameters; in backward, ``on_grads`` receives their gradients as one list.

    ``setup_context`` and ``jvp``: torch.func's transforms (``jvp``, ``vmap``) accept only
    Functions in that form; the whole tensors are not inputs, so their tangents are none."""

    @staticmethod
    def forward(full: list[torch.Tensor], on_grads: Callable[[list], None],  # type: ignore[override]
                *sharded: torch.Tensor):
        return tuple(p.view_as(p) for p in full)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        full, on_grads, *sharded = inputs
        ctx.on_grads = on_grads
        # a frozen tensor's whole copy (LoRA's base) needs no gradient: differentiable, it made autograd
        # keep every frozen layer's inputs and compute its weight gradient (5.75 MiB for 4.32 on a LoRA
        # Llama). A trainable one that got none (unused in this forward) is passed on as None: the
        # engine sums it as zeros and tells FSDP2's None apart at the step (ParoState.used_grads).
        ctx.mark_non_differentiable(*[o for o, s in zip(output, sharded) if not s.requires_grad])
        ctx.set_materialize_grads(False)
        ctx.n = len(full)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        ctx.on_grads(list(grads))
        return (None, None) + (None,) * len(grads)

    @staticmethod
    def jvp(ctx, *tangents: Any) -> tuple:  # type: ignore[override]
        return tuple(None for _ in range(ctx.n))


class OnBackward(torch.autograd.Function):
    """Identity whose backward calls ``callback`` once the tensors' gradients are ready: on a block's
    inputs, after its backward (frozen groups get no ``Unshard`` backward of their own).

    Gradients are not materialised: a tensor that reaches no loss passes None on, not zeros its
    producer's backward would run on. Eager only, so dynamo need not trace ``set_materialize_grads``."""

    @staticmethod
    def forward(callback: Callable[[], None], *tensors: torch.Tensor):  # type: ignore[override]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        ctx.callback = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        ctx.callback()
        return (None,) + grads

    @staticmethod
    def jvp(ctx, callback: Any, *tangents: Any) -> tuple:  # type: ignore[override]
        return tangents


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


def register_post_backward(callback: Callable[[], None], args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``callback`` once the gradients of a block's inputs are ready (its backward is done)."""
    return _route(callback, (args, kwargs))


def register_pre_backward(callback: Callable[[], None], output: Any) -> Any:
    """``callback`` once, at the first gradient reaching one of a block's outputs. A pre-hook on
    each output's node, not an ``OnBackward`` around them, so the caller may modify the outputs in
    place (``h += 1``). For a view, its base's node: an in-place op on the view rebases its
    history past the view's own node, whose hooks then never run."""
    fired = [False]

    def hook(*_: Any) -> None:
        if not fired[0]:
            fired[0] = True
            callback()

    for x in _tensors_in(output):
        if x.requires_grad:
            node = (x._base if x._is_view() else x).grad_fn
            if node is not None:
                node.register_prehook(hook)
            else:  # a leaf handed through
                x.register_hook(hook)
    return output


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree``, inside dataclasses too (torch's pytree does not open them; FSDP2 does)."""
    out: list[torch.Tensor] = []
    for x in tree_flatten(tree)[0]:
        if torch.is_tensor(x):
            out.append(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            out += _tensors_in([getattr(x, f.name) for f in dataclasses.fields(x)])
    return out
