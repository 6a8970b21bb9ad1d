"""Learning-rate schedule: linear warmup, optional stable phase, then decay (torchtitan semantics).

The factor returned for step index ``s`` (0-based, as ``LambdaLR`` counts) is the lr multiplier
of optimizer step ``s + 1``:
  warmup   s < W                : (s + 1) / (W + 1)
  stable   W <= s < W + S       : 1
  decay    W + S <= s < total   : min_lr_factor + (1 - min_lr_factor) * shape(progress),
                                  progress = (s + 1 - W - S) / (D + 1)
with shape linear 1 - p, sqrt 1 - sqrt(p), cosine (1 + cos(pi p)) / 2, or constant 1.
D = total - W when ``decay_ratio`` is unset, else round(total * decay_ratio); S fills the rest.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from .config import LRScheduler as LRConfig


def lr_factor(step: int, warmup_steps: int, stable_steps: int, decay_steps: int, decay_type: str,
              min_lr_factor: float) -> float:
    """Multiplier of the peak lr for the optimizer step that follows ``step`` completed steps."""
    end = warmup_steps + stable_steps + decay_steps
    step = min(step, end)  # past the last step: hold the final value
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step < warmup_steps + stable_steps or decay_steps == 0 or decay_type == "constant":
        return 1.0
    progress = (step + 1 - warmup_steps - stable_steps) / (decay_steps + 1)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type = {decay_type!r}; valid: linear, sqrt, cosine, constant")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def schedule_phases(cfg: LRConfig, total_steps: int) -> tuple[int, int, int]:
    """(warmup, stable, decay) step counts for ``total_steps``."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay = total_steps - warmup
    if cfg.decay_ratio is not None:
        decay = min(round(total_steps * cfg.decay_ratio), decay)
    return warmup, total_steps - warmup - decay, decay


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRConfig, total_steps: int) -> LambdaLR:
    """A ``LambdaLR``; call ``step()`` after each optimizer step."""
    warmup, stable, decay = schedule_phases(cfg, total_steps)
    fn = functools.partial(lr_factor, warmup_steps=warmup, stable_steps=stable, decay_steps=decay,
                           decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor)
    return LambdaLR(optimizer, fn)
