"""Megatron-FSDP 0.6.1 as released (``megatron_fsdp.fully_shard_model`` + ``fully_shard_optimizer``),
on CPU with gloo, each transformer block one FSDP unit (as FSDP2 and PaRO wrap them):

  zero3  ``zero_dp_strategy="optim_grads_params"`` over all ranks (a 1-D data-parallel mesh)
  hsdp   the same within a node, replicas across nodes (``dp_outer_dim``, ``outer_dp_sharding_strategy
         ="no_shard"``); the outer all-reduce on the last micro-step only (``set_model_auto_sync``)
  hfsdp  HSDP whose outer dimension shards the optimizer states and main weights too
         (``outer_dp_sharding_strategy="optim"``): PaRO IIG's layout

torch's AdamW over the Megatron-FSDP parameters (DTensors of its flat buffers), clipping to the
global norm 1.0 (``clip_grad_norm``: torch's ``clip_grad_norm_`` on these uneven DTensors issues
different collectives on different ranks, since a rank whose shard of a parameter is empty holds
no gradient for it, and gloo then fails; so the same arithmetic over the local shards), the loss
divided by A before backward (Megatron-FSDP's gradient scaling divides by the data-parallel size).
The patches it needs are in ``patches.py``; the one config change (no PREMUL_SUM in gloo) is
``ddp_config.gradient_reduce_div_fusion = False``.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any, Callable

from . import Peer
from . import patches as P
from tools.bench.workload import make_optimizer


def clip_grad_norm(params: list, max_norm: float) -> float:
    """torch's ``clip_grad_norm_`` (2-norm, coefficient max_norm / (norm + 1e-6) clamped to 1) over
    DTensor parameters from their local shards: each shard's squared sum once per replica group
    (divided by the sizes of the mesh dimensions it is replicated on), summed over all ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    total = torch.zeros((), dtype=torch.float64)
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        reps = 1
        if hasattr(g, "placements"):
            for d, pl in enumerate(g.placements):
                if isinstance(pl, Replicate):
                    reps *= g.device_mesh.size(d)
        total += local.double().pow(2).sum() / reps
        grads.append(local)
    dist.all_reduce(total)
    norm = total.sqrt().item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def build(peer: Peer, args: argparse.Namespace, model: Any, m: int, active: set[str]) -> SimpleNamespace:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    P.apply(peer, active)
    from megatron_fsdp import fully_shard_model, fully_shard_optimizer

    n = dist.get_world_size()
    unit = type(model.layers[0])
    kw: dict[str, Any] = dict(fsdp_unit_modules=[unit], zero_dp_strategy="optim_grads_params",
                              device=torch.device("cpu"))
    if peer.mode == "zero3":
        mesh = init_device_mesh("cpu", (n, 1), mesh_dim_names=("dp_shard", "tp"))
        kw.update(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    else:
        mesh = init_device_mesh("cpu", (n // m, m, 1), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
        kw.update(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp",
                  hybrid_fsdp_group=mesh["dp_outer", "dp_shard"]._flatten("hsdp").get_group(),
                  outer_dp_sharding_strategy="optim" if peer.mode == "hfsdp" else "no_shard")
    fmodel = fully_shard_model(model, **kw)
    # gloo has no PREMUL_SUM: divide by the data-parallel size as a step of its own (Megatron-FSDP's option)
    fmodel.ddp_config.gradient_reduce_div_fusion = False
    params = list(fmodel.parameters())
    opt = fully_shard_optimizer(make_optimizer(params, args.optimizer))

    def step(batch: Callable[[int], Any], accum: int, probe: Callable[[], None] | None) -> float:
        total = 0.0
        for a in range(accum):
            fmodel.set_model_auto_sync(a == accum - 1)  # the reductions complete on the last micro-step
            loss = fmodel(batch(a)).loss / accum
            loss.backward()
            total += loss.item()
        if probe is not None:
            probe()
        if args.max_norm:
            clip_grad_norm(params, args.max_norm)
        opt.step()
        opt.zero_grad()
        return total

    return SimpleNamespace(step=step, roots=(fmodel, opt))
