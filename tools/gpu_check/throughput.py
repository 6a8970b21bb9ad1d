"""Part (c): tokens/s and MFU of a ~1B Llama on one GPU (a 1-rank NCCL world): PaRO eager and
compiled (``passes.compile_model`` with the graph passes) against FSDP2 eager and
compiled, from the same weights and data.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from .checks import (FAIL, FIRST_LOSS_RTOL, PASS, check, compare_losses, flops_per_token, is_finite, mfu,
                     peak_bf16_flops)
from .memory import init_fn, llama_args
from .plan import C_MODEL, C_STRATEGY, C_TIMED, C_VARIANTS, C_WARMUP
from .report import Emitter, fmt_bytes


def _init_world(device: str) -> Any:
    """A world of one: NCCL on GPU 0 (or gloo on CPU), as ``python train.py`` makes it."""
    import socket

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
        return dev
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _timed_steps(step: Callable[[int], Any], device: Any, warmup: int, timed: int) -> dict[str, Any]:
    import torch

    losses = []
    t0 = time.perf_counter()
    losses.append(step(0))
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for i in range(1, warmup):
        losses.append(step(i))
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(warmup, warmup + timed):
            losses.append(step(i))
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t1 = time.perf_counter()
        for i in range(warmup, warmup + timed):
            losses.append(step(i))
        seconds = time.perf_counter() - t1
    return {"first_step_s": first, "timed_s": seconds, "losses": [float(x) for x in losses]}


def worker_c(emit: Emitter, device_type: str, layers: Optional[int], peak_tflops: Optional[float]) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
    from paro_fsdp.models.llama import Llama

    device = _init_world(device_type)
    kw, default_layers, batch, seq = C_MODEL[device_type]
    args = llama_args(n_layers=layers or default_layers, **kw)
    n_params = args.num_params()
    fpt = flops_per_token(n_params, args.vocab_size * args.dim, args.n_layers, args.dim, seq)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bf16_flops(name, peak_tflops) if device.type == "cuda" else None
    tokens_per_step = batch * seq
    gen = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, args.vocab_size, (batch, seq + 1), generator=gen) for _ in range(C_WARMUP + C_TIMED)]
    torch._dynamo.config.recompile_limit = 64  # PaRO's blocks compile one after another: fail, never fall back
    torch._dynamo.config.accumulated_recompile_limit = 1024
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    print(f"model: {n_params / 1e9:.3f} B parameters, {args.n_layers} layers; {tokens_per_step} tokens per step; "
          f"{fpt / 1e9:.2f} GFLOP per token; peak {peak}", flush=True)

    def build_paro(compiled: bool):
        with torch.device("meta"):
            model = Llama(args)
        model = paro_shard(model, init_paro_mesh(1), C_STRATEGY, mp=MixedPrecision(torch.bfloat16, torch.bfloat16),
                           param_init_fn=init_fn(0, args.n_layers))
        model.init_buffers(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        if compiled:
            import passes

            # as the trainer: every block with its hooks in its graph, the graph passes, and the
            # refresh of the working copies after each step as one graph
            passes.compile_model(model, fullgraph=True)

        def step(i: int) -> torch.Tensor:
            model.set_requires_gradient_sync(True)  # one micro-step per step: its backward runs the boundary
            loss = model(data[i].to(device, non_blocking=True)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return model, step

    def build_fsdp2(compiled: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        with torch.device("meta"):
            model = Llama(args)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        model.to_empty(device=device)
        init = init_fn(0, args.n_layers)
        for pname, p in model.named_parameters():
            init(pname, p.to_local())  # one rank: the local shard is the whole tensor
        model.init_buffers(device)
        if compiled:
            for block in model.layers:
                block.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

        def step(i: int) -> torch.Tensor:
            loss = model(data[i].to(device, non_blocking=True)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return model, step

    results: dict[str, dict[str, Any]] = {}
    for vid, title in C_VARIANTS:
        t0 = time.monotonic()
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if vid.startswith("paro_compiled"):
                torch._dynamo.reset()
            build = build_paro if vid.startswith("paro") else build_fsdp2
            model, step = build(vid.endswith("compiled"))
            r = _timed_steps(step, device, C_WARMUP, C_TIMED)
            r["tokens_per_s"] = tokens_per_step * C_TIMED / r["timed_s"]
            r["step_ms"] = 1e3 * r["timed_s"] / C_TIMED
            r["mfu"] = mfu(r["tokens_per_s"], fpt, peak)
            r["peak_memory"] = float(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None
            r["wall_s"] = time.monotonic() - t0
            results[vid] = r
            del model, step
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others
            import traceback

            traceback.print_exc()
            emit(check("c", f"c.{vid}", title, FAIL, f"{type(exc).__name__}: {exc}"[:300]))
            results[vid] = {"error": str(exc)}
        finally:
            if vid.startswith("paro_compiled"):
                import passes

                passes.uninstall()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = results[vid]
        if "error" in r:
            continue
        base = results.get("fsdp2_eager", {})
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else None
        first = r["losses"][0]
        ref_first = base["losses"][0] if base.get("losses") else first
        same_start = compare_losses({1: ref_first}, {1: first}, FIRST_LOSS_RTOL)
        finite = all(is_finite(x) for x in r["losses"])
        ok = finite and same_start["ok"]
        text = (f"{r['tokens_per_s']:,.0f} tok/s, {r['step_ms']:.0f} ms/step, "
                + (f"MFU {100 * r['mfu']:.1f}%, " if r["mfu"] is not None else "MFU n/a (unknown peak), ")
                + (f"{ratio:.2f}x FSDP2 eager, " if ratio is not None else "")
                + f"first step {r['first_step_s']:.1f} s"
                + (f", peak {fmt_bytes(r['peak_memory'])}" if r["peak_memory"] else "")
                + ("" if finite else "; non-finite loss")
                + ("" if same_start["ok"] else f"; first loss {first:.4f} vs FSDP2 {ref_first:.4f}")
                + ("" if base.get("losses") else "; no FSDP2 eager reference"))
        emit(
            check(
                "c",
                f"c.{vid}",
                title,
                PASS if ok else FAIL,
                text,
                "runs; first loss = FSDP2's (rel 1e-2)",
                ratio_vs_fsdp2_eager=ratio,
                n_params=n_params,
                n_layers=args.n_layers,
                tokens_per_step=tokens_per_step,
                flops_per_token=fpt,
                peak_flops=peak,
                **r,
            )
        )
    dist.destroy_process_group()
