"""``ParoOptimizer``: deprecated; the model's parameters are the optimizer's now, as in FSDP2.

Kept one release: the given torch optimizer over the trainable ``model.parameters()``, forwarded
to. New code: ``torch.optim.AdamW(model.parameters())``.
"""
from __future__ import annotations

import warnings
from typing import Any, Type

import torch
import torch.nn as nn


class ParoOptimizer:
    """Deprecated: ``optimizer_class(trainable model.parameters(), **kwargs)`` behind the old names."""

    def __init__(self, model: nn.Module, optimizer_class: Type[torch.optim.Optimizer], **kwargs: Any) -> None:
        warnings.warn("ParoOptimizer is deprecated: build your optimizer over model.parameters() (they are the fp32 "
                      "parameters at the OS level, as FSDP2's) and use torch.nn.utils.clip_grad_norm_",
                      DeprecationWarning, stacklevel=2)
        if not hasattr(model, "_paro_state"):
            raise ValueError("ParoOptimizer needs a model returned by paro_shard(model, mesh, policy)")
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
        self.inner = optimizer_class(self.params, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` over the parameters; the norm as a plain tensor."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def __getattr__(self, name: str) -> Any:
        """The rest (``step``, ``zero_grad``, ``state_dict``, ...) is the inner optimizer's."""
        if name == "inner":  # __init__ failed before setting it
            raise AttributeError(name)
        return getattr(self.inner, name)
