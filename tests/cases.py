"""Functions that run inside the spawned ranks of the distributed tests (see dist_harness)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paro_fsdp import MixedPrecision

from workloads import STEPS, full_params, train_paro


def _trained(model, losses) -> dict[str, Any]:
    """Losses, final full parameters, and the ledger per step (bytes) and in all (counts)."""
    stats = model.comm_stats()
    return {
        "losses": losses,
        "params": full_params(model),
        "comm": {key: stats.bytes(*key.split("/")) / STEPS for key in stats.as_dict()},
        "counts": {key: stats.count(*key.split("/")) for key in stats.as_dict()},
    }


def train_cases(cases: list[tuple]) -> dict[tuple, dict[str, Any]]:
    """(strategy, group_size, accum[, activation checkpointing]) -> losses, final full params,
    comm ledger, memory."""
    out = {}
    for case in cases:
        strategy, group_size, accum, ac = (*case, None)[:4]
        model, opt, losses = train_paro(strategy, group_size, accum, ac=ac)
        out[case] = {
            **_trained(model, losses),
            "memory": model.memory_report(opt),
            "placements": {n: tuple(repr(p) for p in prm.placements) for n, prm in model.named_parameters()},
            "grad_free": [n for n, prm in model.named_parameters() if not prm.requires_grad],
        }
    return out


def chunked_cases(cases: list[tuple]) -> dict[tuple, dict[str, Any]]:
    """(strategy, group_size, accum, chunk_bytes, "tiny" | "odd"): the engine's global
    collectives cut into PaRO-CC chunks, on the tiny model or on one with uneven shards."""
    from workloads import ODD, TINY

    out = {}
    for case in cases:
        strategy, group_size, accum, chunk_bytes, model_name = case
        model, _, losses = train_paro(strategy, group_size, accum, args={"tiny": TINY, "odd": ODD}[model_name],
                                      chunk_bytes=chunk_bytes)
        out[case] = _trained(model, losses)
    return out


def profile_cases(cases: list[tuple[str, int, int]]) -> dict[tuple, dict[str, Any]]:
    """Count collectives from torch.profiler's records of the ops actually dispatched, beside
    the engine's own ledger, for one optimizer step. The mesh dimension is read from the
    group size, so use a mesh whose two dimensions differ in size."""
    from paro_fsdp import ParoOptimizer, init_paro_mesh, paro_shard
    from workloads import batch, make_model

    kinds = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}
    out = {}
    for strategy, group_size, accum in cases:
        mesh = init_paro_mesh(group_size)
        g, m = mesh.size(0), mesh.size(1)
        dim_of = {m: "intra", g: "inter", g * m: "global"}
        model = paro_shard(make_model(), mesh, strategy)
        opt = ParoOptimizer(model, torch.optim.AdamW, lr=1e-3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for a in range(accum):
                (model(batch(dist.get_rank(), 0, a)).loss / accum).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
        seen: dict[str, float] = {}
        for e in prof.events():
            name = e.name.removeprefix("_c10d_functional::")
            if e.name.startswith("_c10d_functional::") and name in kinds:
                numel = 1
                for s in e.input_shapes[0]:
                    numel *= s
                # all_reduce records no group size: only the scalar grad-norm one (global) is expected
                k = {"all_gather_into_tensor": e.concrete_inputs[1], "reduce_scatter_tensor": e.concrete_inputs[2]}.get(name, g * m if numel == 1 else 0)
                if k == 0:
                    seen["all_reduce/unknown"] = seen.get("all_reduce/unknown", 0.0) + 1
                    continue
                if name == "all_gather_into_tensor":
                    sent = numel * k * (k - 1) / k
                elif name == "reduce_scatter_tensor":
                    sent = numel * (k - 1) / k
                else:
                    sent = 2 * numel * (k - 1) / k
                key = f"{kinds[name]}/{dim_of[k]}"
                seen[key] = seen.get(key, 0.0) + 4 * sent  # fp32
        stats = model.comm_stats()
        out[(strategy, group_size, accum)] = {"profiler": seen, "engine": {key: stats.bytes(*key.split("/")) for key in stats.as_dict()}}
    return out


def bf16_case(strategy: str) -> dict[str, Any]:
    _, _, fp32 = train_paro(strategy, 2, 2)
    model, _, bf16 = train_paro(strategy, 2, 2, mp=MixedPrecision(param_dtype=torch.bfloat16))
    dtypes = {str(p.dtype) for p in model.parameters()}
    return {"fp32": fp32, "bf16": bf16, "dtypes": dtypes}


def accumulate_case(strategy: str, accum: int = 64) -> dict[str, Any]:
    """bf16 params, ``accum`` micro-steps: the master gradients against an fp64 sum of the very
    bf16 gradients each micro-step produces (every rank's, divided by n), with gradients on the
    wire in bf16 or fp32 and the accumulator in fp32 (the default) or bf16. Returns the relative
    errors (norm of the difference over the norm of the reference, all trainable tensors)."""
    import copy

    from torch.distributed.tensor import DTensor

    from paro_fsdp import ParoOptimizer, init_paro_mesh, paro_shard
    from paro_fsdp.layout import placements
    from workloads import batch, make_model

    mesh = init_paro_mesh(2)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_model()
    ref_model = copy.deepcopy(base)
    for p in ref_model.parameters():  # parameters only: buffers (RoPE tables) stay fp32, as in the engine
        p.data = p.data.to(torch.bfloat16)
    ref = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in ref_model.named_parameters() if p.requires_grad}
    for a in range(accum):
        ref_model.zero_grad()
        (ref_model(batch(rank, 0, a)).loss / accum).backward()
        for n, p in ref_model.named_parameters():
            if p.requires_grad:
                ref[n] += p.grad.double()
    for t in ref.values():
        dist.all_reduce(t)
        t /= world
    errors = {}
    for name, wire, acc in (("bf16 wire, fp32 acc", torch.bfloat16, torch.float32),
                            ("bf16 wire, bf16 acc", torch.bfloat16, torch.bfloat16),
                            ("fp32 wire, fp32 acc", torch.float32, torch.float32),
                            ("fp32 wire, bf16 acc", torch.float32, torch.bfloat16)):
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=wire, accumulate_dtype=acc)
        model = paro_shard(copy.deepcopy(base), mesh, strategy, mp=mp)
        opt = ParoOptimizer(model, torch.optim.SGD, lr=0.0)
        for a in range(accum):
            (model(batch(rank, 0, a)).loss / accum).backward()
        opt.clip_grad_norm_(float("inf"))  # the boundary: master grads set, nothing clipped
        diff = norm = 0.0
        for g in opt.groups:
            for master, t in zip(g.master, g.t_layout.tensors):
                whole = DTensor.from_local(master.grad, mesh, placements(g.strategy.os, mesh.size(1)), run_check=False,
                                           shape=t.shape, stride=torch.empty(t.shape, device="meta").stride()).full_tensor()
                want = ref[opt.fqn_of[master]]
                diff += (whole.double() - want).pow(2).sum().item()
                norm += want.pow(2).sum().item()
        errors[name] = (diff / norm) ** 0.5
    return errors


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


def dcp_case(payload: tuple[str, str, str]) -> dict[str, Any]:
    """Train under one strategy, save the optimizer with torch.distributed.checkpoint, load it
    into a fresh model under another strategy; return both sides' whole tensors."""
    import torch.distributed.checkpoint as dcp

    from paro_fsdp import ParoOptimizer, init_paro_mesh, paro_shard
    from workloads import LR, make_model

    src, dst, folder = payload
    model, opt, _ = train_paro(src, 2, 1)
    # frozen weights are model state (P level); trainable ones come back from the fp32 master
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=folder)
    saved = opt.state_dict()
    fresh = paro_shard(make_model(seed=1), init_paro_mesh(2), dst)
    opt2 = ParoOptimizer(fresh, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    sd = {"model": fresh.state_dict(), "optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=folder)
    opt2.load_state_dict(sd["optim"])
    loaded = opt2.state_dict()
    whole = lambda d: {k: v.full_tensor() for k, v in d.items()}  # noqa: E731
    return {
        "params": (full_params(model), full_params(fresh)),
        "master": (whole(saved["master"]), whole(loaded["master"])),
        "exp_avg_sq": ({k: v["exp_avg_sq"].full_tensor() for k, v in saved["state"].items()},
                       {k: v["exp_avg_sq"].full_tensor() for k, v in loaded["state"].items()}),
        "step": (saved["state"]["output.weight"]["step"], loaded["state"]["output.weight"]["step"]),
    }


def meta_init_case(strategy: str) -> dict[str, Any]:
    """A model built on the meta device and materialised shard by shard inside paro_shard equals
    the same model initialised whole, then sharded."""
    from functools import partial

    from paro_fsdp import init_paro_mesh, paro_shard
    from paro_fsdp.models.llama import Llama
    from workloads import TINY

    mesh = init_paro_mesh(2)
    whole = Llama(TINY)
    whole.init_weights(seed=7)
    whole = paro_shard(whole, mesh, strategy)
    with torch.device("meta"):
        lazy = Llama(TINY)
    lazy = paro_shard(lazy, mesh, strategy, param_init_fn=partial(lazy.init_param, seed=7))
    lazy.init_buffers(torch.device("cpu"))
    x = torch.randint(0, TINY.vocab_size, (2, 9))
    return {"params": (full_params(whole), full_params(lazy)), "loss": (whole(x).loss.item(), lazy(x).loss.item())}


def suite(payload: dict[str, Any]) -> dict[str, Any]:
    """Run several kinds of cases in one world: {"train": [...], "profile": [...], "bf16": [...], "errors": True}."""
    out: dict[str, Any] = {}
    if "train" in payload:
        out["train"] = train_cases(payload["train"])
    if "chunked" in payload:
        out["chunked"] = chunked_cases(payload["chunked"])
    if "profile" in payload:
        out["profile"] = profile_cases(payload["profile"])
    if "bf16" in payload:
        out["bf16"] = {s: bf16_case(s) for s in payload["bf16"]}
    if "accumulate" in payload:
        out["accumulate"] = {s: accumulate_case(s) for s in payload["accumulate"]}
    if "meta" in payload:
        out["meta"] = {s: meta_init_case(s) for s in payload["meta"]}
    if "dcp" in payload:
        out["dcp"] = dcp_case(payload["dcp"])
    if payload.get("errors"):
        out["errors"] = error_cases(None)
    return out
