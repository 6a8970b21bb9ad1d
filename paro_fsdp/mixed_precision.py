"""Compute and communication dtypes. The optimizer's master copy is always fp32."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .collectives import check_wire


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of P (stored shard, all-gathers, compute).
    ``reduce_dtype``: dtype gradients travel in (defaults to ``param_dtype``). In float16 (FSDP2's
    fp16, with a loss scaler) each rank's gradient is divided by ``predivide(n)`` before its first
    reduction and the rest of 1/n at the step, as FSDP2 divides, so the sum over the ranks stays
    in fp16's range; every other dtype is summed and divided once, at the step.
    ``accumulate_dtype``: dtype of the G-level sum over micro-steps; fp32 by default, as FSDP2's
    sharded gradients, since the running sum outgrows each addend and bf16 rounds late micro-steps
    away (docs/api.md). ``None``: the reduce dtype (half the G memory).
    ``cast_forward_inputs``: floating-point model inputs cast to ``param_dtype`` at the model's
    entry only (a block's fp32 inputs, RoPE tables, are deliberate), as FSDP2's.
    ``inter_dtype``: what crosses between groups, quantized: "int8" (parameters and gradients) or
    "int4" (gradients; parameters int8), block-wise scaled, gradients summed in fp32 where they
    arrive (quantize.py); None, the default: the dtypes above, exact. Inside a group nothing changes.
    ``output_dtype``: floating-point outputs of each sharded module cast to it after its forward, as
    FSDP2's (None: left as computed).
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: Optional[torch.dtype] = None
    accumulate_dtype: Optional[torch.dtype] = torch.float32
    cast_forward_inputs: bool = True
    inter_dtype: Optional[str] = None
    output_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "accumulate_dtype"):
            value = getattr(self, name)
            if value is not None and value not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"MixedPrecision.{name} must be torch.float32, bfloat16 or float16, got {value}")
        if self.output_dtype is not None and not (isinstance(self.output_dtype, torch.dtype)
                                                  and self.output_dtype.is_floating_point):
            raise ValueError(f"MixedPrecision.output_dtype must be a floating torch dtype, got {self.output_dtype!r}")
        check_wire(self.inter_dtype, "MixedPrecision.inter_dtype")
        if self.accumulate_dtype == torch.float16:
            raise ValueError("MixedPrecision: accumulate_dtype=torch.float16 sums undivided gradients "
                             "and overflows at scale; "
                             "set accumulate_dtype=torch.float32 (the default) or torch.bfloat16")

    @property
    def input_dtype(self) -> Optional[torch.dtype]:
        """What the model's floating-point inputs are cast to (None: left as they are)."""
        return self.param_dtype if self.cast_forward_inputs and self.param_dtype != torch.float32 else None

    def predivide(self, divide: float) -> float:
        """The part of the division by ``divide`` (the world size, or ``set_gradient_divide_factor``'s)
        applied before the reduction, about its square root: FSDP2's pre-divide factor for fp16 (the
        same doubling rule, so the sums match FSDP2's); 1 in other dtypes."""
        if self.grad_dtype != torch.float16:
            return 1.0
        factor = 1
        while divide % factor == 0 and divide / factor > factor:
            factor *= 2
        return float(factor)

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def acc_dtype(self) -> torch.dtype:
        """The G-level accumulator's dtype."""
        return self.accumulate_dtype or self.grad_dtype
