"""Six model families ``strategy="auto"`` was not fitted on, tiny, built here (nothing downloaded): a tied
LM (GPT-2), an encoder-decoder (T5, its head tied to the shared embedding), a mixture of experts
(Mixtral, 4 experts, top-2: its fake kernel refuses fp32), a vision transformer with parameters at the
root, a conv net, and a model with frozen and trainable parts (Llama with LoRA). Each with its
micro-batches (the same in every process for a rank and step) and the loss a user's loop computes."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

FAMILIES = ("gpt2", "t5", "mixtral", "vit", "conv", "lora")
B, T, IMAGE, CLASSES = 2, 12, 16, 10


class ViT(nn.Module):
    """Patches by a convolution, a class token and positions at the root, encoder layers, a head."""

    def __init__(self, dim: int = 32, depth: int = 2, patch: int = 4, image: int = IMAGE, classes: int = CLASSES,
                 mlp: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, mlp * dim, dropout=0.0, batch_first=True)
                                    for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h[:, 0]))


class ConvNet(nn.Module):
    """A stem, residual conv blocks (GroupNorm: no batch statistics, so ranks and one process agree), a head."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(4, width),
                                                  nn.GELU(), nn.Conv2d(width, width, 3, padding=1))
                                    for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h.mean(dim=(2, 3)))


def build(family: str) -> nn.Module:
    """The model of ``family``, the same weights in every process (seed 0)."""
    torch.manual_seed(0)
    if family == "gpt2":
        import hf_models

        return hf_models.make("gpt2")
    if family == "lora":
        import hf_models

        return hf_models.make("llama", lora={"target_modules": ["q_proj", "v_proj"]})
    if family == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        return T5ForConditionalGeneration(T5Config(vocab_size=272, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0))
    if family == "mixtral":
        from transformers import AutoModelForCausalLM, MixtralConfig

        return AutoModelForCausalLM.from_config(MixtralConfig(
            vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64),
            dtype=torch.float32)
    if family == "vit":
        return ViT()
    if family == "conv":
        return ConvNet()
    raise ValueError(family)


def batch(family: str, rank: int, step: int, micro: int) -> tuple[Any, torch.Tensor]:
    """(the forward's input, the targets) of one micro-batch."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    if family in ("vit", "conv"):
        return torch.randn(B, 3, IMAGE, IMAGE, generator=gen), torch.randint(0, CLASSES, (B,), generator=gen)
    ids = torch.randint(0, 256, (B, T), generator=gen)
    return {"input_ids": ids, "labels": ids}, ids


def loss_fn(family: str, targets: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """The loss of the output: the model's own (``labels``), else cross-entropy outside the model."""
    if family in ("vit", "conv"):
        return lambda logits: nn.functional.cross_entropy(logits, targets)
    return lambda out: out.loss


def forward_loss(family: str, model: nn.Module, micro: tuple[Any, torch.Tensor]) -> torch.Tensor:
    x, y = micro
    return loss_fn(family, y)(model(**x) if isinstance(x, dict) else model(x))


def joined(family: str, micros: list[tuple[Any, torch.Tensor]]) -> tuple[Any, torch.Tensor]:
    """Every rank's micro-batch side by side: what one process runs for them."""
    xs, ys = zip(*micros)
    if isinstance(xs[0], dict):
        return {k: torch.cat([x[k] for x in xs]) for k in xs[0]}, torch.cat(ys)
    return torch.cat(xs), torch.cat(ys)
