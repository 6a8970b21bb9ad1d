"""Compute and communication dtypes. The optimizer's master copy is always fp32."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of P (stored shard, all-gathers, compute).
    ``reduce_dtype``: dtype gradients travel in (every reduce-scatter / all-reduce, per micro-step
    and at the accumulation boundary); defaults to ``param_dtype``.
    ``accumulate_dtype``: dtype of the G-level buffer that sums gradients over micro-steps;
    fp32 by default, as FSDP2 keeps its sharded gradients. Why: with A micro-steps the running
    sum grows ~A times larger than each addend, and a bf16 sum rounds away up to a quarter of a
    late micro-step's gradient at A = 64. ``None`` accumulates in ``reduce_dtype`` (half the
    G memory, the old behaviour, an explicit choice).
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: Optional[torch.dtype] = None
    accumulate_dtype: Optional[torch.dtype] = torch.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "accumulate_dtype"):
            value = getattr(self, name)
            if value is not None and value not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"MixedPrecision.{name} must be torch.float32, bfloat16 or float16, got {value}")

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def acc_dtype(self) -> torch.dtype:
        """The G-level accumulator's dtype."""
        return self.accumulate_dtype or self.grad_dtype
