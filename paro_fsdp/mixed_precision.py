"""Compute and communication dtypes. The optimizer's master copy is always fp32."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of P (stored shard, all-gathers, compute).
    ``reduce_dtype``: dtype of G (reduce-scatters, accumulation); defaults to ``param_dtype``.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"MixedPrecision.{name} must be torch.float32, bfloat16 or float16, got {value}")

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype
