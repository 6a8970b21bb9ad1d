"""A parameter group's accumulation boundary (the summed gradient, G level -> OS level over all ranks,
into the fp32 masters' ``.grad``) and push (the updated masters, OS level -> P level).

Why generators: each issues a collective, yields it and, resumed, waits for it (results leave through
``out`` lists), so ``drive`` keeps every group's collectives in flight together and ``run`` runs the same
code in the compiled last micro-step and push (traced.py). Plain ``yield``, ``for``-delegation and lists
are what dynamo traces inside a backward (no ``yield from``, no generator return values).
"""
from __future__ import annotations

from typing import Generator

import torch
from torch.distributed.tensor import DTensor

from .collectives import Dim, Kind
from .comm import Work
from .param_group import GradState, ParoParamGroup
from .plan import Move
from .strategy import Level

#: one group's sequence of collectives
Steps = Generator[Work, None, None]


def run(steps: Steps) -> None:
    """One sequence to its end, each collective waited at once (traced: the graph passes decide the overlap)."""
    for _ in steps:
        pass


def drive(sequences: list[Steps]) -> None:
    """Sequences side by side: every group's next collective is issued before any waits for its previous
    one (every rank runs the same groups in the same order, so the collectives match across ranks)."""
    active = list(sequences)
    while active:
        nxt = []
        for seq in active:
            try:
                next(seq)
                nxt.append(seq)
            except StopIteration:
                pass
        active = nxt


def finalize_grads(group: ParoParamGroup) -> Steps:
    """The accumulated gradient, reduced over all ranks at the OS level, into the parameters' ``.grad``."""
    if not group.trainable or group.grads is not GradState.AT_G:
        return
    out: list[torch.Tensor] = []
    for pending in reduce_to_os(group, group.grad_acc.sum(), out):
        yield pending
    group.grad_acc.free()  # its sum is in out[0] (where nothing moved, out[0] is it): one buffer, not two
    set_master_grads(group, out[0])


def reduce_to_os(group: ParoParamGroup, acc: torch.Tensor, out: list[torch.Tensor]) -> Steps:
    """The G-level sum -> the OS level over all ranks (the plan's boundary), appended to ``out``: in the
    reduce dtype, or the accumulate dtype where no collective runs."""
    if group.plan.boundary and group.info.n > 1:
        acc = acc.to(group.mp.grad_dtype)
    for pending in run_moves(group, group.plan.boundary, acc, out):
        yield pending


def run_moves(group: ParoParamGroup, moves: tuple[Move, ...], flat: torch.Tensor, out: list[torch.Tensor],
              into: torch.Tensor | None = None) -> Steps:
    """A phase's moves on a flat buffer of the trainable tensors, each between the layouts its levels need;
    the result is appended to ``out`` (written into ``into`` where given)."""
    for i, move in enumerate(moves):
        pending = _issue(group, move, flat)
        yield pending
        flat = _arrive(group, move, pending.wait(), into if i == len(moves) - 1 else None)
    out.append(flat)


def _issue(group: ParoParamGroup, move: Move, flat: torch.Tensor) -> Work:
    """One move on the wire: global ones on NESTED buffers, inter reductions on the I shard as [g, sum_g]."""
    layout, dt, kind, wire = group.t_layout, flat.dtype, move.kind, move.wire
    if move.dim == Dim.GLOBAL:
        if kind == Kind.REDUCE_SCATTER:
            empty = torch.empty if layout.nested_uniform else torch.zeros
            nested = layout.full_to_nested(flat, empty(layout.numel_nested(), dtype=dt, device=group.device))
            return group.cc.reduce_scatter(nested, order="nested", wire=wire)
        if kind == Kind.ALL_GATHER:
            return group.cc.all_gather(flat, order="nested", wire=wire)
        return group.cc.all_reduce(flat, wire=wire)
    if move.dim == Dim.INTER and kind == Kind.REDUCE_SCATTER:
        flat = layout.i_to_inter(flat, torch.empty(group.info.g * layout.sum_g, dtype=dt, device=group.device))
    return getattr(group.comm, str(kind))(flat, move.dim, wire=wire)


def _arrive(group: ParoParamGroup, move: Move, result: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """A gathered result back to the layout of its level (FULL, or the I buffer)."""
    layout = group.t_layout
    if move.kind != Kind.ALL_GATHER or move.dim == Dim.INTRA:
        return result
    if move.dim == Dim.GLOBAL:
        whole = torch.empty(layout.numel(Level.N), dtype=result.dtype, device=group.device)
        return layout.nested_to_full(result, whole)
    return layout.inter_to_i(result, into if into is not None else
                             torch.empty(layout.sum_i, dtype=result.dtype, device=group.device))


def set_master_grads(group: ParoParamGroup, reduced: torch.Tensor) -> None:
    """``reduced`` / n (or ``grad_divide_factor``) into the parameters' ``.grad`` (OS-level fp32 DTensors),
    added to what an earlier reducing backward left, as FSDP2 accumulates; the accumulator is freed.
    ``reduced`` is scaled in place and the ``.grad`` view it, so the peak holds one OS-level fp32 gradient,
    not the accumulator and a scaled copy at once."""
    layout, OS, dt = group.t_layout, group.strategy.os, group.mp.grad_dtype
    scale = group.predivide / group.divide  # fp16: the part of the division not made before the sums
    if group.plan.masters_whole:
        grads = []
        for master, t in zip(group.master, layout.tensors):
            tmp = torch.empty(group.info.m * t.size_i, dtype=dt, device=group.device)
            layout.copy_out(reduced, t, tmp)
            grads.append(tmp[: master.numel()].view(master.shape).to(torch.float32) * scale)
    else:
        flat = reduced.to(torch.float32).mul_(scale)  # one fp32 buffer per group; grads are views
        grads = [layout.local_view(flat, t, OS) for t in layout.tensors]
    unused, group.unused = group.unused, None
    # the traced path tracks nothing: its tensors count as used (zeros, not None, under torch.compile)
    group.used_here = [True] * len(grads) if unused is None else [not u for u in unused]
    for i, (param, grad) in enumerate(zip(group.sharded_params, grads)):
        if not param.requires_grad:  # frozen after sharding (requires_grad_(False)): no gradient, as FSDP2's
            continue
        none_here = unused is not None and unused[i]
        if none_here:  # no gradient on this rank: on another? ParoState.used_grads decides, then its hooks
            group.undecided.append((i, param, param.grad is None))
        if param.grad is None:
            param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
        else:
            param.grad._local_tensor.add_(grad)
        if not none_here:  # its gradient is final: the post-accumulate-grad hooks run now, as FSDP2 runs
            run_grad_hooks(param)  # them after its reduce-scatter (an optimizer in backward steps here)
    group.grad_acc.free()
    group.grads = GradState.EMPTY


def run_grad_hooks(param: torch.Tensor) -> None:
    """``param``'s post-accumulate-grad hooks (optimizer_hooks defers a push a step in them starts)."""
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def push_params(group: ParoParamGroup) -> Steps:
    """The changed fp32 masters to the P level in param dtype (the plan's push, under ``torch.no_grad()``), then
    the local slice a finer P needs; nothing where P is the master (``shares_p``, ``casts_p``)."""
    if not group.trainable or group.shares_p or group.casts_p:
        return
    layout, plan, dt = group.t_layout, group.plan, group.mp.param_dtype
    if plan.masters_whole:  # every rank updated whole tensors: slice
        for local, master, t in zip(group.p_locals, group.master, layout.tensors):
            local.copy_(t.local_slice(master, group.strategy.p, group.info.k))
        return
    out: list[torch.Tensor] = []
    into = group.p_flat if plan.push_reaches_p and not plan.params_whole else None  # straight into P's storage
    for pending in run_moves(group, plan.push, group.master_flat.to(dt), out, into=into):
        yield pending
    if plan.params_whole:  # gathered to FULL: into the whole working tensors
        for local, t in zip(group.p_locals[: len(group.trainable)], layout.tensors):
            tmp = torch.empty(group.info.m * t.size_i, dtype=dt, device=group.device)
            layout.copy_out(out[0], t, tmp)
            local.copy_(tmp[: local.numel()].view(local.shape))
    elif plan.push_reaches_p:
        if out[0] is not group.p_flat:
            group.p_flat[: out[0].numel()].copy_(out[0])
    else:  # P = G from OS = I: a slice
        layout.i_to_g(out[0], group.p_flat)
