"""The one dtype table: configs, tools and the cost model spell dtypes two ways ("bf16" on the
command line, "bfloat16" in TOML as torchtitan does); both map here, so a new dtype is added once."""
from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_of", "short_name"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                                  "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """A dtype from either spelling (or a dtype, returned as is); one line naming the choices if unknown."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}") from None


def short_name(dtype: str | torch.dtype) -> str:
    """"bf16", "fp32" or "fp16": the spelling logs, tables and the cost model use."""
    return _SHORT[dtype_of(dtype)]
