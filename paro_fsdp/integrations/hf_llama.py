"""The trainer's own Llama (``paro_fsdp/models/llama.py``) under Hugging Face names, so its runs
open in transformers as a ``LlamaForCausalLM``.

One layout differs: RoPE. Ours rotates interleaved pairs (x[2i], x[2i+1]), transformers' halves
(x[i], x[i + head_dim/2]), so ``wq`` and ``wk`` rows are permuted within each head (as
``convert_llama_weights_to_hf`` does); that crosses shard boundaries, so those two are gathered
whole, one at a time.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from paro_fsdp.models.llama import LlamaArgs

__all__ = ["llama_config", "hf_name", "hf_values", "rope_to_halves"]

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {**{f"attention.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkvo"},
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}


def llama_config(args: LlamaArgs) -> Any:
    """The ``LlamaConfig`` of the same model."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
                       num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                       num_key_value_heads=args.n_kv_heads or args.n_heads, head_dim=args.dim // args.n_heads,
                       rms_norm_eps=args.norm_eps, max_position_embeddings=args.max_seq_len,
                       rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                       tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                       architectures=["LlamaForCausalLM"])


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    layers, i, rest = name.split(".", 2)
    if layers != "layers" or rest not in _LAYER:
        raise KeyError(f"{name} has no Hugging Face Llama name")
    return f"model.layers.{i}.{_LAYER[rest]}"


def rope_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q / k projection from interleaved RoPE pairs to transformers' halves."""
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, head_dim // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def hf_values(model: torch.nn.Module, args: LlamaArgs) -> dict[str, DTensor]:
    """The sharded Llama's fp32 parameters under Hugging Face names and layouts, for
    ``integrations.hf.save_model``. Collective (``wq`` and ``wk`` are gathered)."""
    from paro_fsdp.integrations.hf import parameters_state

    out: dict[str, DTensor] = {}
    for name, value in parameters_state(model).items():
        heads = {"wq": args.n_heads, "wk": args.n_kv_heads or args.n_heads}.get(name.rsplit(".", 2)[-2])
        if heads is not None:
            mesh = value.device_mesh
            value = DTensor.from_local(rope_to_halves(value.full_tensor(), heads), mesh, [Replicate()] * mesh.ndim,
                                       run_check=False)
        out[hf_name(name)] = value
    return out
