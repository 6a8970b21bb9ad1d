"""The engine's hooks on torch's optimizer step.

The user's optimizer is a plain torch.optim one over the parameters, so the engine learns of the
update from torch's global step hooks and queues the pushes to P as the step ends; the next
forward's root starts them (the root's pre-forward checks again, for writes no optimizer made:
loads, in-place edits). Nothing is left in flight after a step, so ``dist.destroy_process_group``
and a rank that exits early meet no collective of the engine's.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .hooks import in_backward
from .param_group import GradState

_watched: weakref.WeakSet = weakref.WeakSet()  # every live model's ParoState (state.py)
_hook_handle = None


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The parameters with a gradient count as written (torch's foreach ops through DTensor and its
    fused kernels write in place without moving version counters); then the pushes start."""
    stepped = {id(p): p for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
    for state in list(_watched):  # only the models this optimizer updated (another may be alive)
        mine = [stepped[id(p)] for g in state.groups for p in g.sharded_params[: len(g.trainable)] if id(p) in stepped]
        if mine:
            torch.autograd.graph.increment_version(mine)
            if in_backward():  # an optimizer in backward (a post-accumulate-grad hook): the blocks still
                state.refresh_after_backward = True  # gathered for backward reshard at its end, then push
            else:
                state.refresh_params()


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step over parameters whose gradients are still at the G level (every backward since the
    last step ran with ``set_requires_gradient_sync(False)``) would silently skip them: refuse. Inside
    backward (an optimizer in a post-accumulate-grad hook) the other groups are still reducing: allowed."""
    if in_backward():
        return
    pending = [g for state in list(_watched) for g in state.groups if g.grads is GradState.AT_G]
    if not pending:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for g in pending:
        if any(id(p) in stepped and p.grad is None for p in g.sharded_params[: len(g.trainable)]):
            raise RuntimeError(f"optimizer.step(): the gradients of {g.trainable[0].fqn} (and its block) "
                               "were never reduced: "
                               f"every backward since the last step ran with set_requires_gradient_sync(False); call "
                               f"model.set_requires_gradient_sync(True) before the last micro-step's backward")


def watch(state) -> None:
    global _hook_handle
    _watched.add(state)
    if _hook_handle is None:
        _hook_handle = (register_optimizer_step_pre_hook(_before_optimizer_step),
                        register_optimizer_step_post_hook(_after_optimizer_step))


def unwatch(state) -> None:
    _watched.discard(state)
