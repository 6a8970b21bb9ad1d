"""The accumulation boundary of one parameter group: the summed gradient from the G level to the
OS level over all ranks, handed to the fp32 masters; after the optimizer step, the updated
masters from the OS level to the P level.

Why generators of a group rather than its methods: each issues a collective, yields it, and when
resumed waits for it and goes on (results leave through ``out`` lists), so ``drive`` can keep every
group's boundary collectives in flight together, and ``run`` runs the same code in the compiled
last micro-step (traced.py) and the compiled push (``ParoOptimizer.compile``). Plain ``yield``,
``for``-delegation and lists are what dynamo traces inside a backward (no ``yield from``, no
generator return values).
"""
from __future__ import annotations

from typing import Generator

import torch
from torch.distributed.tensor import DTensor

from .comm import Work
from .param_group import GradState, ParoParamGroup
from .strategy import Level

#: one group's sequence of collectives
Steps = Generator[Work, None, None]


def run(steps: Steps) -> None:
    """Run one sequence to its end, each collective waited as soon as it is issued (traced
    code: the graph passes, not the issue order, decide the overlap)."""
    for _ in steps:
        pass


def drive(sequences: list[Steps]) -> None:
    """Run several groups' sequences side by side: every group's next collective is issued
    before any group waits for its previous one. Every rank runs the same groups in the same
    order, so the collectives on each process group match across ranks."""
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
    acc = group.grad_acc.sum()
    out: list[torch.Tensor] = []
    for pending in reduce_to_os(group, acc, out):
        yield pending
    set_master_grads(group, out[0])


def reduce_to_os(group: ParoParamGroup, acc: torch.Tensor, out: list[torch.Tensor]) -> Steps:
    """The G-level sum over micro-steps -> the OS level, summed over all ranks, appended to
    ``out``. It travels in the reduce dtype; with no collective to run (G = OS = G) it stays in
    the accumulate dtype."""
    layout, G, OS, dt = group.t_layout, group.strategy.g, group.strategy.os, group.mp.grad_dtype
    if not (G == Level.G and OS == Level.G) and group.info.n > 1:
        acc = acc.to(dt)
    reduced, level = acc, G
    if G == Level.N and OS == Level.G:  # global reduce-scatter (PaRO-CC)
        empty = torch.empty if layout.nested_uniform else torch.zeros
        pending = group.cc.reduce_scatter(layout.full_to_nested(acc, empty(layout.numel_nested(), dtype=dt, device=group.device)),
                                              order="nested")
        yield pending
        reduced, level = pending.wait(), Level.G
    elif G == Level.N and OS == Level.N:  # global all-reduce (PaRO-CC), elementwise on FULL
        pending = group.cc.all_reduce(acc)
        yield pending
        reduced = pending.wait()
    elif G != Level.G:  # to I, still partial over inter
        if G == Level.N:
            pending = group.comm.reduce_scatter(acc, "intra")
            yield pending
            reduced = pending.wait()
        if OS == Level.G:
            pending = group.comm.reduce_scatter(
                layout.i_to_inter(reduced, torch.empty(group.info.g * layout.sum_g, dtype=dt, device=group.device)), "inter")
            yield pending
            reduced, level = pending.wait(), Level.G
        else:
            pending = group.comm.all_reduce(reduced, "inter")
            yield pending
            reduced, level = pending.wait(), Level.I
    for pending in gather_up(group, reduced, level, OS, out):
        yield pending


def set_master_grads(group: ParoParamGroup, reduced: torch.Tensor) -> None:
    """``reduced`` (from ``reduce_to_os``) / n (or / ``grad_divide_factor``) into the parameters'
    ``.grad`` (fp32 DTensors at the OS level), added to what an earlier reducing backward left
    there, as FSDP2 accumulates its sharded gradients; the accumulator is freed."""
    layout, OS, dt = group.t_layout, group.strategy.os, group.mp.grad_dtype
    scale = 1.0 / (group.info.n if group.grad_divide_factor is None else group.grad_divide_factor)
    if OS == Level.N:
        grads = []
        for master, t in zip(group.master, layout.tensors):
            tmp = torch.empty(group.info.m * t.size_i, dtype=dt, device=group.device)
            layout.copy_out(reduced, t, tmp)
            grads.append(tmp[: master.numel()].view(master.shape).to(torch.float32) * scale)
    else:
        flat = reduced.to(torch.float32) * scale  # one fp32 buffer per group; grads are views
        grads = [layout.local_view(flat, t, OS) for t in layout.tensors]
    for param, grad in zip(group.sharded_params, grads):
        if param.grad is None:
            param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
        else:
            param.grad._local_tensor.add_(grad)
    group.grad_acc.free()
    group.grads = GradState.EMPTY


def gather_up(group: ParoParamGroup, flat: torch.Tensor, level: Level, target: Level, out: list[torch.Tensor]) -> Steps:
    """All-gather a flat buffer of the trainable tensors from ``level`` to the coarser ``target``
    (G -> I -> N); appends the result to ``out``."""
    layout = group.t_layout
    if level == Level.G and target == Level.N:  # global all-gather (PaRO-CC) -> NESTED -> FULL
        pending = group.cc.all_gather(flat, order="nested")
        yield pending
        flat, level = layout.nested_to_full(pending.wait(), torch.empty(layout.numel(Level.N), dtype=flat.dtype, device=group.device)), Level.N
    if level == Level.G and target != Level.G:
        pending = group.comm.all_gather(flat, "inter")
        yield pending
        flat, level = layout.inter_to_i(pending.wait(), torch.empty(layout.sum_i, dtype=flat.dtype, device=group.device)), Level.I
    if level == Level.I and target == Level.N:
        pending = group.comm.all_gather(flat, "intra")
        yield pending
        flat = pending.wait()
    out.append(flat)


def push_params(group: ParoParamGroup) -> Steps:
    """After the parameters changed (an optimizer step, a load): the fp32 masters to the P level in
    param dtype (under ``torch.no_grad()``); nothing where P is the master (``shares_p``)."""
    if not group.trainable or group.shares_p:
        return
    layout, P, OS, dt = group.t_layout, group.strategy.p, group.strategy.os, group.mp.param_dtype
    n_t = len(group.trainable)
    if OS == Level.N:  # every rank updated whole tensors: slice
        for local, master, t in zip(group.p_locals, group.master, layout.tensors):
            local.copy_(t.local_slice(master, P, group.info.k))
        return
    flat = group.master_flat.to(dt)
    if P == OS:
        group.p_flat[: flat.numel()].copy_(flat)
    elif P == Level.G:  # OS = I: a slice
        layout.i_to_g(flat, group.p_flat)
    elif P == Level.I:  # OS = G: inter all-gather
        pending = group.comm.all_gather(flat, "inter")
        yield pending
        layout.inter_to_i(pending.wait(), group.p_flat)
    else:  # P = N from OS = I or G
        out: list[torch.Tensor] = []
        for pending in gather_up(group, flat, OS, Level.N, out):
            yield pending
        for local, t in zip(group.p_locals[:n_t], layout.tensors):
            tmp = torch.empty(group.info.m * t.size_i, dtype=dt, device=group.device)
            layout.copy_out(out[0], t, tmp)
            local.copy_(tmp[: local.numel()].view(local.shape))
