"""Tiny Hugging Face models for the tests, made here from a config (never downloaded): Llama,
Qwen2, GPT-2 with its head tied to the token embedding, a LoRA adapter on Llama; model folders
written with ``save_pretrained`` (one safetensors file, or shards via ``max_shard_size``) with a
byte-level ``tokenizer.json`` built locally with the ``tokenizers`` library."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

VOCAB = 272  # the byte tokenizer's 256 + 2 special tokens, padded
KINDS = ("llama", "qwen2", "gpt2")


def config(kind: str, vocab: int = VOCAB) -> Any:
    """A two-block model of ``kind``, dim 32 (GPT-2: tied embeddings, no dropout)."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, bos_token_id=256, eos_token_id=257)
    if kind == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=128, **common)
    if kind == "qwen2":
        return Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=128, **common)
    if kind == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, tie_word_embeddings=True, **common)
    raise ValueError(kind)


def make(kind: str, seed: int = 0, lora: Optional[dict] = None, vocab: int = VOCAB) -> torch.nn.Module:
    """The model with weights from ``seed`` (the same on every process); ``lora``: peft LoraConfig
    arguments, wrapped with ``get_peft_model``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind, vocab), dtype=torch.float32)
    if lora is not None:
        import peft

        torch.manual_seed(seed + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(**{"r": 4, "lora_alpha": 8, **lora}))
    return model


def byte_tokenizer_json(path: str) -> str:
    """A byte-level BPE ``tokenizer.json`` without merges: the 256 byte symbols (ids 0..255)
    then ``<s>`` and ``</s>``. Built with the ``tokenizers`` library, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(path)
    return path


def save_folder(kind: str, path: str, seed: int = 0, max_shard_size: Optional[str] = None, vocab: int = VOCAB,
                tokenizer: bool = True) -> str:
    """``save_pretrained`` of ``make(kind, seed)`` into ``path`` (shards when ``max_shard_size``),
    with a ``tokenizer.json``."""
    model = make(kind, seed, vocab=vocab)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        byte_tokenizer_json(os.path.join(path, "tokenizer.json"))
    return path
