"""The tools' optimizer, the FSDP2 way: torch's AdamW over the sharded model's parameters.

Why a helper: the engine refreshes its P-level working copies when the parameters' version
counters move after ``optimizer.step()`` (docs/fsdp2.md), and in torch 2.13 two of AdamW's three
implementations write the DTensor parameters without moving them: ``foreach`` (torch's default
on CUDA, and what the benchmarks use) and ``fused`` (the trainer's, and parts (b) and (c) of the
GPU check). The working copies then stay stale: every forward after the first step runs on the
initial weights. So every PaRO optimizer of the tools bumps the counters after each step, as the
trainer's does (``paro_fsdp.train.optimizer.mark_written_after_step``); a bump the engine did not
need costs nothing.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch


def adamw(params: Iterable[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)`` whose steps the engine sees, whatever the
    implementation."""
    from paro_fsdp.train.optimizer import mark_written_after_step

    optimizer = torch.optim.AdamW(params, **kwargs)
    mark_written_after_step(optimizer)
    return optimizer
