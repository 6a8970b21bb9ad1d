"""What the benchmarks on 4 spawned gloo ranks share (``vs_fsdp2.py``, ``compiled.py``): the
mesh (2 groups x 2 ranks), the bench Llama and its command-line flags, each step's data, the
optimizer settings (also those of the emulated ``headline.py``), and the cross-rank reductions
their tables report.

Why one module: every variant of every benchmark must train the same model on the same data with
the same AdamW, or the ratios compare different work.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from paro_fsdp.models.llama import Llama, LlamaArgs

WORLD, GROUP = 4, 2
LR, WD, MAX_NORM = 1e-3, 0.1, 1.0
SGD_LR = 0.1  # the peers' ``--optimizer sgd``: plain SGD shows a gradient's scale, which Adam hides


def make_optimizer(params: Any, optimizer: str = "adamw") -> torch.optim.Optimizer:
    """The bench's AdamW, or plain SGD (``SGD_LR``, no momentum) for the gradient-scale checks."""
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, foreach=True)
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True)


def make_model(args: LlamaArgs, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(args)


class MLPStack(nn.Module):
    """Residual blocks of Linear -> GELU -> Linear, regressing each token's next one in a fixed
    random embedding (a buffer, not trained): a model whose every parameter sits in a block and
    costs 6 FLOPs per token, so compute against traffic is set by its width alone. Takes the
    Llama benchmarks' token batches and returns ``.loss`` as Llama does."""

    def __init__(self, dim: int, ffn: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))
                                    for _ in range(layers))
        self.register_buffer("table", torch.randn(vocab, dim, generator=torch.Generator().manual_seed(1)))

    def forward(self, tokens: torch.Tensor) -> SimpleNamespace:
        h, target = self.table[tokens[:, :-1]], self.table[tokens[:, 1:]]
        for layer in self.layers:
            h = h + layer(h)
        return SimpleNamespace(loss=(h - target).pow(2).mean())


def batch_for(cfg: Any, rank: int, step: int, micro: int) -> torch.Tensor:
    """Micro-step ``micro`` of step ``step`` on ``rank`` (``cfg``: a config with ``args``, ``batch``, ``seq``)."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, cfg.args.vocab_size, (cfg.batch, cfg.seq + 1), generator=gen)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The bench model's shape and micro-batch (shared by vs_fsdp2.py and compiled.py)."""
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=352)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)


def model_args_from(ns: argparse.Namespace) -> LlamaArgs:
    return LlamaArgs(dim=ns.dim, n_layers=ns.layers, n_heads=ns.heads, n_kv_heads=ns.kv_heads, vocab_size=ns.vocab,
                     ffn_dim=ns.ffn, max_seq_len=ns.seq)


def reduce_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def reduce_mean(values: list[torch.Tensor]) -> list[float]:
    t = torch.stack([v.double() for v in values])
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()

