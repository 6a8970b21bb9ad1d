"""DeepSpeed as released (ZeRO-3, ZeRO++ hpZ / qwZ / qgZ on 0.19.8, MiCS on 0.19.0), on CPU with
gloo: DeepSpeed's CPU accelerator picks gloo when oneCCL is not installed (nothing patched for
that). The client optimizer is torch's AdamW (``zero_allow_untested_optimizer``: ZeRO-3 steps it
over its fp32 partitions), clipping is DeepSpeed's ``gradient_clipping`` (the global norm, as
torch's ``clip_grad_norm_``), A is ``gradient_accumulation_steps`` (``engine.backward`` divides
the loss by A; ``set_train_batch_size`` switches A between the bench's A values). Every other
ZeRO setting is DeepSpeed's default except the sizes, which DeepSpeed sets for large GPU models
(a 5e8-element reduce bucket: 2 GB of fp32 allocated per rank for a 1M-parameter model): the
reduce and prefetch buckets hold one transformer block (FSDP2's and PaRO's unit of collectives)
and parameters of fewer than 10 x dim elements stay whole on every rank (Hugging Face's "auto"
rule for ``stage3_param_persistence_threshold``).
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any, Callable

from . import Peer
from . import patches as P
from tools.bench.workload import make_optimizer


def config(peer: Peer, args: argparse.Namespace, m: int, accum: int, world: int, block: int) -> dict:
    zero: dict[str, Any] = {"stage": 3, "reduce_bucket_size": block, "stage3_prefetch_bucket_size": block,
                            "stage3_param_persistence_threshold": 10 * args.dim}
    if peer.mode in ("hpz", "zeropp"):  # ZeRO++ hpZ: a secondary copy of the weights sharded within a node
        zero["zero_hpz_partition_size"] = m
    if peer.mode == "zeropp":  # ZeRO++ qwZ (int8 weight all-gather) and qgZ (int4 all-to-all gradient reduction)
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    if peer.mode == "mics":  # MiCS: shards within a node (groups of m), replicas across nodes
        zero.update(mics_shard_size=m, mics_hierarchical_params_gather=False)
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": accum,
            "train_batch_size": args.batch * accum * world, "gradient_clipping": args.max_norm,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


def build(peer: Peer, args: argparse.Namespace, model: Any, m: int, active: set[str]) -> SimpleNamespace:
    import deepspeed
    import torch.distributed as dist

    P.apply(peer, active)
    deepspeed.init_distributed(dist_backend="gloo")  # deepspeed.comm over the gloo group the worker made
    world = dist.get_world_size()
    accum0 = int(args.accum.split(",")[0])
    block = max(sum(p.numel() for p in b.parameters()) for b in model.layers)
    cfg = config(peer, args, m, accum0, world, block)
    if peer.mode == "mics":  # MiCS's optimizer takes MiCS parameters only: convert the model built (same init)
        deepspeed.zero.MiCS_Init(module=model, config_dict_or_path=cfg)
    opt = make_optimizer(model.parameters(), args.optimizer)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    state = {"accum": accum0}

    def step(batch: Callable[[int], Any], accum: int, probe: Callable[[], None] | None) -> float:
        if accum != state["accum"]:
            engine.set_train_batch_size(args.batch * accum * world)
            state["accum"] = accum
        total = 0.0
        for a in range(accum):
            loss = engine(batch(a)).loss
            engine.backward(loss)  # divides by A
            total += loss.item() / accum
            if probe is not None and a == accum - 1:
                probe()
            engine.step()  # the optimizer step on the last micro-step only
        return total

    return SimpleNamespace(step=step, roots=(engine, opt))
