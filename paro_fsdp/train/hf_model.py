"""The trainer's Hugging Face path: ``--model.name hf --model.hf_path DIR`` (and ``[peft]``).

The pieces are ``integrations.hf``'s. A folder's problem is an ``HFModelError``: one line, status 2.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from paro_fsdp.dtypes import dtype_of
from paro_fsdp.integrations import hf
from paro_fsdp.integrations.hf import HFModelError
from paro_fsdp.models.llama import LlamaArgs

from .config import JobConfig, tokenizer_spec

__all__ = ["HFModelError", "shape_args", "build_meta_model", "load", "loss", "export", "TOKENIZER_FILES"]

# what a model folder carries besides the weights, copied into the export so it loads as a whole
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def shape_args(cfg: JobConfig, tokenizer_vocab: int) -> LlamaArgs:
    """The folder's model as ``LlamaArgs`` shapes, once the tokenizer fits its embedding and seq_len its positions."""
    path = cfg.model.hf_path
    c = hf.read_config(path)
    c = c.get_text_config() if callable(getattr(c, "get_text_config", None)) else c
    hf.weight_files(path)
    vocab = int(c.vocab_size)
    if tokenizer_vocab > vocab:
        raise HFModelError(f"the tokenizer ({tokenizer_spec(cfg)}) has {tokenizer_vocab} ids, more than the {vocab} "
                           f"rows of {path}'s embedding: ids from {vocab} on index outside it; valid: the model's own "
                           f"tokenizer (model.tokenizer = \"auto\": its folder's tokenizer.json) or one of at most "
                           f"{vocab} ids")
    positions = getattr(c, "max_position_embeddings", None)
    if positions and cfg.training.seq_len > positions:
        raise HFModelError(f"training.seq_len = {cfg.training.seq_len} exceeds the {positions} positions of {path} "
                           f"(max_position_embeddings); valid: at most {positions}")
    dim, heads = int(c.hidden_size), int(c.num_attention_heads)
    return LlamaArgs(dim=dim, n_layers=int(c.num_hidden_layers), n_heads=heads,
                     n_kv_heads=getattr(c, "num_key_value_heads", None) or heads, vocab_size=vocab,
                     ffn_dim=int(getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * dim),
                     norm_eps=float(getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_epsilon", 1e-5)),
                     max_seq_len=int(positions or cfg.training.seq_len))


def build_meta_model(cfg: JobConfig) -> nn.Module:
    """The folder's model on the meta device (LoRA when ``peft.lora_rank``), checked against the safetensors."""
    path, p = cfg.model.hf_path, cfg.peft
    model = hf.build_meta(hf.read_config(path))
    if p.lora_rank:
        model = hf.add_lora(model, p.lora_rank, p.lora_alpha, p.lora_dropout, p.target_modules or None, base_path=path)
    hf.check_weights({n: tuple(t.shape) for n, t in model.named_parameters()}, path)
    return model


def load(model: nn.Module, cfg: JobConfig, device: torch.device) -> None:
    """After ``paro_shard``: the buffers (RoPE tables), then each rank's shards of the weights. Collective."""
    hf.materialise_buffers(model, device)
    hf.load_weights(model, cfg.model.hf_path)


def loss(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a ``[B, T + 1]`` window on fp32 logits, as the trainer's Llama computes it."""
    out = model(input_ids=window[:, :-1], use_cache=False)
    return F.cross_entropy(out.logits.float().flatten(0, 1), window[:, 1:].flatten())


def export(model: nn.Module, cfg: JobConfig, args: LlamaArgs, step: int) -> tuple[str, str]:
    """``checkpoint.last_save_in_hf``: a Hugging Face folder (LoRA: the adapter); (path, how to load it). Collective."""
    base = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder, f"step-{step}-hf")
    dtype = dtype_of(cfg.checkpoint.export_dtype)
    tokenizer = tokenizer_spec(cfg)
    if cfg.model.name == "hf":
        path = cfg.model.hf_path
        if cfg.peft.lora_rank:
            out = hf.save_adapter(model, base + "-adapter", dtype=dtype)
            return out, (f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({os.path.abspath(path)!r}), "
                         f"{os.path.abspath(out)!r})")
        extras = [os.path.join(path, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
        if tokenizer != path and os.path.exists(tokenizer):  # --model.tokenizer: the one it trained with
            extras = [f for f in extras if "tokenizer" not in os.path.basename(f)] + [_tokenizer_file(tokenizer)]
        out = hf.save_model(model, base, hf.read_config(path), dtype=dtype, extra_files=extras)
    else:
        from paro_fsdp.integrations.hf_llama import hf_values, llama_config

        extras = [_tokenizer_file(tokenizer)] if tokenizer != "byte" else []
        out = hf.save_model(model, base, llama_config(args), dtype=dtype, values=hf_values(model, args),
                            extra_files=extras)
    return out, f"AutoModelForCausalLM.from_pretrained({os.path.abspath(out)!r})"


def _tokenizer_file(spec: str) -> str:
    return os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
