"""Functions that run inside the spawned ranks of the distributed tests (see dist_harness)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paro_fsdp import MixedPrecision

from workloads import STEPS, full_params, train_paro


def train_cases(cases: list[tuple[str, int, int]]) -> dict[tuple, dict[str, Any]]:
    """(strategy, group_size, accum) -> losses, final full params, comm ledger, memory."""
    out = {}
    for strategy, group_size, accum in cases:
        model, opt, losses = train_paro(strategy, group_size, accum)
        stats = model.comm_stats()
        out[(strategy, group_size, accum)] = {
            "losses": losses,
            "params": full_params(model),
            "comm": {key: stats.bytes(*key.split("/")) / STEPS for key in stats.as_dict()},
            "counts": {key: stats.count(*key.split("/")) for key in stats.as_dict()},
            "memory": model.memory_report(opt),
            "placements": {n: tuple(repr(p) for p in prm.placements) for n, prm in model.named_parameters()},
            "grad_free": [n for n, prm in model.named_parameters() if not prm.requires_grad],
        }
    return out


def bf16_case(strategy: str) -> dict[str, Any]:
    _, _, fp32 = train_paro(strategy, 2, 2)
    model, _, bf16 = train_paro(strategy, 2, 2, mp=MixedPrecision(param_dtype=torch.bfloat16))
    dtypes = {str(p.dtype) for p in model.parameters()}
    return {"fp32": fp32, "bf16": bf16, "dtypes": dtypes}


def error_cases(_: Any) -> dict[str, str]:
    """Each bad input must raise; return the messages."""
    from paro_fsdp import ParoOptimizer, init_paro_mesh, paro_shard
    from workloads import make_model

    msgs = {}
    try:
        init_paro_mesh(3)
    except ValueError as e:
        msgs["group_size"] = str(e)
    mesh = init_paro_mesh(2)
    try:
        paro_shard(make_model(), mesh, "IXG")
    except ValueError as e:
        msgs["letters"] = str(e)
    try:
        paro_shard(make_model(), mesh, {"layers.*.attention.wq.weigth": "GGG", "default": "IIG"})
    except ValueError as e:
        msgs["pattern"] = str(e)
    model = paro_shard(make_model(), mesh, "IIG")
    opt = ParoOptimizer(model, torch.optim.AdamW, lr=1e-3)
    try:
        opt.step()
    except RuntimeError as e:
        msgs["no_backward"] = str(e)
    dist.barrier()
    return msgs
