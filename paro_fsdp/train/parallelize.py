"""The model and its parallelism for a config: the process group and device, Llama args (or a Hugging Face folder,
``hf_model``), the strategy (``auto``: the advisor's), activation checkpointing, then PaRO sharding.

Activation checkpointing wraps each block's whole ``__call__``, engine hooks included, so the recomputation
re-runs the pre-forward hook, which gathers the parameters again (hooks outside a checkpointed ``forward``
would save other tensors than forward).
"""
from __future__ import annotations

import datetime
import os
import socket
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from paro_fsdp import MixedPrecision, paro_shard
from paro_fsdp.dtypes import dtype_of, short_name
from paro_fsdp.mesh import device_type_for_backend, local_cuda_index
from paro_fsdp.models.llama import Llama, LlamaArgs, flavor

from .config import ConfigError, JobConfig
from .torchrun import restart_store


def init_distributed(cfg: JobConfig) -> torch.device:
    """The process group, unless the caller made one (a plain ``python train.py``: a world of one on a free port;
    under torchrun a fresh key space per restart attempt), and this rank's device: one GPU per process, named to
    NCCL so it need not guess. ``training.deterministic`` is set here too."""
    backend = cfg.comm.backend
    if dist.is_initialized():
        backend = dist.get_backend()
    else:
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if device_type_for_backend(backend) == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"comm.backend = \"{backend}\" needs CUDA GPUs and none is visible; valid: auto, gloo")
        if "RANK" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        timeout = datetime.timedelta(seconds=cfg.comm.init_timeout_seconds)
        kwargs: dict[str, Any] = {"timeout": timeout}
        store = restart_store(timeout)
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        if device_type_for_backend(backend) == "cuda":
            kwargs["device_id"] = torch.device("cuda", local_cuda_index())
            torch.cuda.set_device(kwargs["device_id"])
        dist.init_process_group(backend, **kwargs)
    if cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if device_type_for_backend(backend) == "cuda":
        torch.cuda.set_device(local_cuda_index())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_args(cfg: JobConfig, tokenizer_vocab: int) -> LlamaArgs:
    """The flavor's shapes, vocabulary and RoPE tables widened to the tokenizer and ``seq_len`` (or the HF folder's)."""
    if cfg.model.name == "hf":
        from . import hf_model

        return hf_model.shape_args(cfg, tokenizer_vocab)
    base = flavor(cfg.model.flavor)
    vocab = cfg.model.vocab_size if cfg.model.vocab_size != -1 else max(base.vocab_size, tokenizer_vocab)
    if vocab < tokenizer_vocab:
        raise ValueError(f"model.vocab_size = {vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}); "
                         f"valid: -1 or at least {tokenizer_vocab}")
    return flavor(cfg.model.flavor, vocab_size=vocab, max_seq_len=max(base.max_seq_len, cfg.training.seq_len))


def build_loss_fn(cfg: JobConfig) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``loss(model, window)``: the Llama's own, or a Hugging Face model's next-token cross entropy."""
    if cfg.model.name == "hf":
        from .hf_model import loss

        return loss
    return lambda model, batch: model(batch).loss


def paro_policy(cfg: JobConfig) -> Any:
    """``paro_strategy`` alone, or the ``paro_policy`` table with ``paro_strategy`` as default."""
    p = cfg.parallelism
    if not p.paro_policy:
        return p.paro_strategy
    table = dict(p.paro_policy)
    table.setdefault("default", p.paro_strategy)
    return table


class _CheckpointedCall:
    """Mixed into a block's class: the whole module call (hooks included) under non-reentrant checkpointing."""

    checkpoint_in_graph = False  # set by passes.compile_model per block: the compiled call checkpoints itself

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.checkpoint_in_graph:
            return nn.Module.__call__(self, *args, **kwargs)
        with set_checkpoint_early_stop(False):
            return checkpoint(nn.Module.__call__, self, *args, use_reentrant=False, **kwargs)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks checkpointed, sharded as units and compiled one by one (Llama layers or HF decoder layers)."""
    if isinstance(model, Llama):
        return list(model.layers)
    from paro_fsdp.integrations.hf import decoder_blocks

    return decoder_blocks(model)


def apply_activation_checkpointing(model: nn.Module) -> None:
    for block in transformer_blocks(model):
        cls = block.__class__
        block.__class__ = type(f"Checkpointed{cls.__name__}", (_CheckpointedCall, cls), {})


def build_model(cfg: JobConfig, args: LlamaArgs, device: torch.device) -> nn.Module:
    """The model on the meta device: ``parallelize`` materialises it shard by shard, so no rank holds it whole."""
    if cfg.model.name == "hf":
        from . import hf_model

        return hf_model.build_meta_model(cfg)
    with torch.device("meta"):
        return Llama(args)


def mixed_precision(cfg: JobConfig) -> MixedPrecision:
    t, wire = cfg.training, cfg.parallelism.inter_dtype
    return MixedPrecision(dtype_of(t.mixed_precision_param), dtype_of(t.mixed_precision_reduce),
                          dtype_of(t.mixed_precision_accumulate), inter_dtype=None if wire == "none" else wire)


def parallelize(model: nn.Module, cfg: JobConfig, mesh: Any, device: torch.device) -> nn.Module:
    """AC (if asked), then ``paro_shard``: parameters seeded by (``training.seed``, name), alike on every rank;
    a Hugging Face model's weights are then read from its folder, each rank reading its shards."""
    if cfg.activation_checkpoint.mode == "full":
        apply_activation_checkpointing(model)
    t, mp = cfg.training, mixed_precision(cfg)
    hf = cfg.model.name == "hf"
    if hf:
        from paro_fsdp.integrations.hf import init_for_load

        init, blocks = init_for_load(t.seed), transformer_blocks(model)
    else:
        init, blocks = partial(model.init_param, seed=t.seed), None
    model = paro_shard(model, mesh, paro_policy(cfg), mp=mp, blocks=blocks,
                       reshard_after_forward=cfg.parallelism.paro_reshard_after_forward,
                       flat_below_bytes=int(cfg.parallelism.paro_flat_below_mb * 2**20), param_init_fn=init)
    if hf:
        from . import hf_model

        hf_model.load(model, cfg, device)
    else:
        model.init_buffers(device)
    return model


def check_policy(cfg: JobConfig, args: LlamaArgs) -> None:
    """The engine's error for the policy against the model's names (meta device: no memory spent), as a ConfigError."""
    from paro_fsdp.strategy import resolve_policy

    if cfg.model.name == "hf":
        from . import hf_model

        names = list(hf_model.build_meta_model(cfg).named_parameters())
    else:
        with torch.device("meta"):
            names = list(Llama(args).named_parameters())
    try:
        resolve_policy(paro_policy(cfg), names)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"parallelism.paro_policy: {exc}") from None


def advise(cfg: JobConfig, args: LlamaArgs, world: int, group: int, accum: int, cluster: Any,
           trainable_fraction: float = 1.0) -> tuple[Any, str]:
    """The advisor's (``paro_fsdp/cost/``) ranking of the 27 strategies for this config on ``cluster``: (the fastest
    that fits, the table)."""
    from paro_fsdp.cost.predict import choose_strategy

    t = cfg.training
    return choose_strategy(args, world, group, t.local_batch_size, accum, t.seq_len,
                           short_name(t.mixed_precision_param), cluster, trainable_fraction=trainable_fraction,
                           reduce_dtype=short_name(t.mixed_precision_reduce),
                           activation_checkpoint=cfg.activation_checkpoint.mode,
                           reshard_after_forward=cfg.parallelism.paro_reshard_after_forward,
                           inter_dtype=mixed_precision(cfg).inter_dtype)


def auto_strategy(cfg: JobConfig, args: LlamaArgs, mesh: Any, accum: int, device: torch.device,
                  log: Callable[[str], None]) -> str:
    """``paro_strategy = "auto"``: the advisor's choice on the cluster file, or this mesh's cached calibration; the
    table is logged and rank 0's choice broadcast, so every rank shards the same way."""
    from paro_fsdp.cost.calibration_cache import cached_calibration
    from paro_fsdp.cost.cluster import AdvisorError, load_cluster

    t, p = cfg.training, cfg.parallelism
    fraction = 1.0
    if cfg.peft.lora_rank:  # the adapters' share of the weights, from the model on the meta device
        from paro_fsdp.integrations.hf import count_trainable

        trainable, total = count_trainable(build_model(cfg, args, device))
        fraction = trainable / total
    try:
        if p.paro_cluster_file:
            cluster, source = load_cluster(p.paro_cluster_file), p.paro_cluster_file
        else:
            calibrated = cached_calibration(mesh, args, t.local_batch_size, t.seq_len,
                                            short_name(t.mixed_precision_param))
            cluster, source = calibrated.cluster, calibrated.source
        if p.memory_budget_gib:
            return _budgeted(cfg, args, mesh, accum, device, log, cluster, source)
        strategy, table = advise(cfg, args, dist.get_world_size(), mesh.size(1), accum, cluster, fraction)
    except AdvisorError as exc:
        raise ConfigError(f"parallelism.paro_strategy = \"auto\": {exc}") from None
    choice = [strategy.name]
    dist.broadcast_object_list(choice, src=0)
    log(f"paro_strategy = auto ({source}):\n{table}")
    log(f"paro_strategy = auto: training with {choice[0]}")
    return choice[0]


def _budgeted(cfg: JobConfig, args: LlamaArgs, mesh: Any, accum: int, device: torch.device,
              log: Callable[[str], None], cluster: Any, source: str) -> str:
    """``memory_budget_gib``: rank 0's plan per block (``cost.budget``) for the model as built (meta device: LoRA
    and frozen weights as they will be) set as ``paro_policy``; returns its most used strategy, the default."""
    from collections import Counter

    from paro_fsdp.cost.budget import Workload, plan_blocks, units_of
    from paro_fsdp.cost.model import model_spec

    t, p, mp = cfg.training, cfg.parallelism, mixed_precision(cfg)
    meta = build_model(cfg, args, device)
    work = Workload(t.local_batch_size, t.seq_len, accum, cfg.activation_checkpoint.mode == "full", model=args)
    plan = plan_blocks(units_of(meta, transformer_blocks(meta)), dist.get_world_size(), mesh.size(1),
                       p.memory_budget_gib * 2**30, cluster, work, model_spec(args), mp.param_dtype.itemsize,
                       mp.grad_dtype.itemsize, mp.acc_dtype.itemsize, p.paro_reshard_after_forward,
                       int(p.paro_flat_below_mb * 2**20), inter_dtype=mp.inter_dtype)
    box = [plan.policy()]
    dist.broadcast_object_list(box, src=0)
    log(f"paro_strategy = auto, memory_budget_gib = {p.memory_budget_gib:g} ({source}):\n{plan.table()}")
    p.paro_policy = box[0]
    default = Counter(box[0].values()).most_common(1)[0][0]
    log(f"paro_strategy = auto: training with a strategy per block (parallelism.paro_policy), mostly {default}")
    return default
