"""gloo's reduce-scatter at a ring's bytes, for every system the emulator runs.

Why: gloo (torch 2.11 to 2.14) runs ``reduce_scatter_tensor`` as an all-reduce of the whole input
and keeps the rank's chunk, so it sends twice what NCCL's ring sends ((k-1)/k of the input per
rank): measured on 2 gloo ranks with the kernel's loopback counters, a 32 MiB reduce-scatter sends
64.1 MiB, as much as an all-reduce; an all-gather of the same size, 32.0 MiB. On the emulated
cluster every reduce-scatter over the slow link (PaRO IIG's and GGG's boundary and GGG's
micro-steps, FSDP2 full shard, DeepSpeed ZeRO-3, Megatron-FSDP ZeRO-3 and HFSDP) then pays double,
and layouts that cross it with an all-reduce (HSDP, PaRO III / NII) look better than they are on
GPUs. Here the reduce-scatter is an all-to-all (each rank sends chunk j to rank j: (k-1)/k of the
input, the ring's bytes) and a local reduction of the k chunks received.

Installed as the CPU kernels of the ``c10d`` ops every path reaches (``dist.reduce_scatter_tensor``,
the functional collectives and torch.compile's graphs, ``_coalescing_manager``: ProcessGroup
dispatches them through these ops), in the worker's process only, the same for PaRO and every
peer: ``tools.emulate.launch`` sets ``PARO_EMU_GLOO_RS=all_to_all`` unless the environment says
``PARO_EMU_GLOO_RS=gloo`` (gloo's own kernel, to compare). The result equals gloo's up to the
order of the float additions.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["CHOICES", "install", "install_from_env"]

#: ``PARO_EMU_GLOO_RS`` values: the all-to-all kernel (the default), or gloo's own
CHOICES = ("all_to_all", "gloo")
_LIB: torch.library.Library | None = None
_C = torch._C._distributed_c10d
_R = dist.ReduceOp.RedOpType
_REDUCE = {int(_R.SUM): lambda x: x.sum(0), int(_R.AVG): lambda x: x.mean(0), int(_R.PRODUCT): lambda x: x.prod(0),
           int(_R.MIN): lambda x: x.amin(0), int(_R.MAX): lambda x: x.amax(0)}


def _issue(output: torch.Tensor, inp: torch.Tensor, pg: dist.ProcessGroup, reduce_op) -> torch.futures.Future:
    """All-to-all ``inp``'s k chunks, then reduce the k received into ``output`` (once they land)."""
    k = pg.size()
    op = int(reduce_op.op())
    if op not in _REDUCE:
        raise RuntimeError(f"tools.emulate.gloo_rs: reduce op {op} is not supported; run with "
                           f"PARO_EMU_GLOO_RS=gloo")
    inp = inp.contiguous()
    recv = torch.empty_like(inp)
    work = pg.alltoall_base(recv, inp, [], [], _C.AllToAllOptions())

    def land(_):
        output.copy_(_REDUCE[op](recv.view(k, *output.shape)))
        return output

    return work.get_future().then(land)


def _reduce_scatter_base(output, inp, process_group, reduce_op, async_op=True, timeout=-1):
    fut = _issue(output, inp, _C.ProcessGroup.unbox(process_group), reduce_op)
    return output, _C._create_work_from_future(fut).boxed()


def _reduce_scatter_coalesced(outputs, inputs, process_group, reduce_op, async_op=True, timeout=-1):
    pg = _C.ProcessGroup.unbox(process_group)
    futs = [_issue(o, i, pg, reduce_op) for o, i in zip(outputs, inputs)]
    return _C._create_work_from_future(torch.futures.collect_all(futs)).boxed()


def _reduce_scatter_list(outputs, input_lists, process_group, reduce_op, async_op=True, timeout=-1):
    pg = _C.ProcessGroup.unbox(process_group)
    futs = [_issue(o, torch.cat([t.reshape(-1) for t in ins]).view(len(ins), *o.shape), pg, reduce_op)
            for o, ins in zip(outputs, input_lists)]
    return outputs, _C._create_work_from_future(torch.futures.collect_all(futs)).boxed()


def install() -> None:
    """The all-to-all reduce-scatter as the CPU kernel of c10d's reduce-scatter ops. Idempotent."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("c10d", "IMPL")
    lib.impl("_reduce_scatter_base_", _reduce_scatter_base, "CPU")
    lib.impl("reduce_scatter_tensor_coalesced_", _reduce_scatter_coalesced, "CPU")
    lib.impl("reduce_scatter_", _reduce_scatter_list, "CPU")
    _LIB = lib


def install_from_env() -> str:
    """Install it when ``PARO_EMU_GLOO_RS`` (set by the emulator's launch) asks for it; returns the
    choice in force (``gloo`` outside the emulator)."""
    choice = os.environ.get("PARO_EMU_GLOO_RS", "gloo")
    if choice not in CHOICES:
        raise ValueError(f"PARO_EMU_GLOO_RS={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "all_to_all":
        import warnings

        with warnings.catch_warnings():  # torch warns once that the kernel overrides its own
            warnings.simplefilter("ignore", UserWarning)
            install()
    return choice
