"""Build the model for a config: Llama args (or a Hugging Face folder, ``hf_model``), activation
checkpointing, then PaRO sharding.

Activation checkpointing wraps each block's whole ``__call__``, engine hooks included, so the
recomputation in backward re-runs the pre-forward hook, which hands the block its gathered
parameters again (hooks outside a checkpointed ``forward`` would save other tensors than forward).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from paro_fsdp import MixedPrecision, paro_shard
from paro_fsdp.models.llama import Llama, LlamaArgs, flavor

from .config import JobConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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

    checkpoint_in_graph = False  # apply_compile, per block: the compiled call checkpoints itself (compile_block)

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


def parallelize(model: nn.Module, cfg: JobConfig, mesh: Any, device: torch.device) -> nn.Module:
    """AC (if asked), then ``paro_shard``: parameters seeded by (``training.seed``, name), alike on every rank;
    a Hugging Face model's weights are then read from its folder, each rank reading its shards."""
    if cfg.activation_checkpoint.mode == "full":
        apply_activation_checkpointing(model)
    t = cfg.training
    mp = MixedPrecision(param_dtype=DTYPES[t.mixed_precision_param], reduce_dtype=DTYPES[t.mixed_precision_reduce],
                        accumulate_dtype=DTYPES[t.mixed_precision_accumulate])
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


def apply_compile(model: nn.Module, cfg: JobConfig) -> None:
    """torch.compile in place (whole, or per block) after ``paro_shard``, so collectives are graph nodes.
    Whoever drives the run installs ``[compile] passes`` first (``passes.install_for``): the package never does."""
    from paro_fsdp.traced import compile_block, isolate_compile_cache

    isolate_compile_cache(torch.distributed.get_rank())
    c = cfg.compile
    if cfg.activation_checkpoint.mode == "full":
        # the block hooks swap module parameters (a side effect): in a checkpointed block dynamo
        # must not replay it in the recomputation, which the compiled graph does by itself
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if c.scope == "model":
        model.compile(backend=c.backend)
    else:  # not block.compile(): its graph would leave out the engine's hooks (traced.compile_block)
        for block in transformer_blocks(model):
            checkpointed = isinstance(block, _CheckpointedCall)
            if checkpointed:
                block.checkpoint_in_graph = True
            compile_block(block, checkpointed=checkpointed, backend=c.backend, fullgraph=True)


def check_policy(cfg: JobConfig, args: LlamaArgs) -> Optional[str]:
    """The engine's error for the policy against the model's names (meta device: no memory spent), or None."""
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
        return f"parallelism.paro_policy: {exc}"
    return None
