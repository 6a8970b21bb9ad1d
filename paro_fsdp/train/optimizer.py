"""The trainer's optimizer: torch's, built over the sharded model's parameters (FSDP2's contract).

Why over ``model.parameters()``: each trainable parameter *is* its fp32 master with its reduced
``.grad``, so torch's optimizers, ``clip_grad_norm_`` and schedulers work unchanged (docs/fsdp2.md).
Why two param groups: as HF's Trainer, only ``ndim >= 2`` tensors decay (not norms or biases).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .config import Optimizer as OptimizerConfig

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in model order: decayed (``ndim >= 2``) and not, empty groups left out."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad = False)")
    if weight_decay == 0:
        return [{"params": trainable}]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, o: OptimizerConfig) -> torch.optim.Optimizer:
    """``[optimizer]``'s torch optimizer over the sharded model's trainable parameters."""
    return OPTIMIZERS[o.name](param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                              weight_decay=o.weight_decay, **IMPLEMENTATIONS[o.implementation])


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's over the trainable parameters' ``.grad``; the global norm before clipping as a plain
    0-dim tensor. ``max_norm = inf`` only measures it."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
