"""A Llama decoder (RMSNorm, RoPE, SwiGLU, SDPA attention, optional GQA) in plain torch.

Flavors follow LLaMA-1 shapes for 7B/13B/65B; ``debug`` is small enough for CPU tests.
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = 32000
    ffn_dim: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    def num_params(self) -> int:
        kv = self.n_kv_heads or self.n_heads
        hd = self.dim // self.n_heads
        attn = self.dim * self.dim * 2 + 2 * self.dim * kv * hd
        layer = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.n_layers * layer + 2 * self.vocab_size * self.dim + self.dim


FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=176, max_seq_len=256),
    "llama7b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    "llama13b": LlamaArgs(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824),
    "llama65b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, ffn_dim=22016),
}


def flavor(name: str, **overrides) -> LlamaArgs:
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; choose one of {sorted(FLAVORS)}")
    return replace(FLAVORS[name], **overrides)


class ModelOutput(NamedTuple):
    loss: Optional[torch.Tensor]
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


INIT_RNG_ENV = "PARO_INIT_RNG"


def _init_rng_device(device: torch.device) -> torch.device:
    """Where seeded init draws its values: the tensor's device, or the CPU with ``$PARO_INIT_RNG=cpu``."""
    choice = os.environ.get(INIT_RNG_ENV, "").strip().lower()
    if choice in ("", "device"):
        return device
    if choice == "cpu":
        return torch.device("cpu")
    raise ValueError(f"${INIT_RNG_ENV} = {choice!r} is not valid; valid: device (the default: the tensor's device), "
                     f"cpu (the CPU generator's values on any device)")


def rope_tables(head_dim: int, seq_len: int, theta: float,
                device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x is [B, T, H, D]."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv = a.n_heads, a.n_kv_heads or a.n_heads
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.wq(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, self.n_kv, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, self.n_kv, self.head_dim)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        for name, p in self.named_parameters():
            if p.device.type != "meta":
                self.init_param(name, p, seed)

    @torch.no_grad()
    def init_param(self, name: str, tensor: torch.Tensor, seed: Optional[int] = None) -> None:
        """Initialise one parameter in place, on the device it lives on (not one CPU thread per rank).

        With a ``seed`` the values depend only on (seed, name, device type), so a model materialised
        tensor by tensor inside ``paro_shard`` gets the same values on every rank, in any order
        (CUDA's values depend on the GPU model: a job must not mix them). ``$PARO_INIT_RNG=cpu``
        draws on the CPU on every device, so a GPU run starts from a CPU run's exact weights."""
        if tensor.dim() == 1:
            tensor.fill_(1.0)
            return
        std = 0.02 / (math.sqrt(2 * self.args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0)
        if seed is None:
            tensor.normal_(0.0, std)
            return
        where = _init_rng_device(tensor.device)
        gen = torch.Generator(device=where).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if where == tensor.device and tensor.dtype == torch.float32 and tensor.is_contiguous():
            tensor.normal_(0.0, std, generator=gen)
        else:  # the fp32 values, then cast, scattered or copied: the same values whatever the target
            values = torch.empty(tensor.shape, dtype=torch.float32, device=where)
            tensor.copy_(values.normal_(0.0, std, generator=gen))

    def init_buffers(self, device: torch.device) -> None:
        """RoPE tables computed on ``device`` (for a model built on the meta device)."""
        self.rope_cos, self.rope_sin = rope_tables(self.args.dim // self.args.n_heads, self.args.max_seq_len,
                                                   self.args.rope_theta, device=device)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None) -> ModelOutput:
        """``tokens`` [B, T]; without ``labels`` it is a [B, T+1] window predicting itself shifted."""
        if labels is None:
            tokens, labels = tokens[:, :-1], tokens[:, 1:]
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return ModelOutput(loss, logits)
