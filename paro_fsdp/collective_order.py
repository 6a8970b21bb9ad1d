"""A debug check that every rank issues the same collectives in the same order.

Why: a collective one rank issues and another does not hangs until the timeout (or, on gloo, pairs
with the wrong call), and compiled graphs can differ per rank. How: a dispatch mode fingerprints
each ``_c10d_functional`` collective (kind, mesh dimension, shape, dtype) and compares it across
ranks on a gloo group of its own *before* it is issued, and the end of the step too. One small
all-gather per collective: a debug switch (``comm.check_collective_order``).
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

END = "end of step"


class CollectiveOrderError(RuntimeError):
    """Ranks disagree on the collective sequence; the message is one line naming the first difference."""


def fingerprint(func: Any, args: tuple, dims: dict[str, str]) -> Optional[str]:
    """``kind over dim of dtype[shape]`` for a ``_c10d_functional`` collective, None for any other op
    (and for ``wait_tensor``, which issues nothing)."""
    if getattr(func, "namespace", None) != "_c10d_functional" or "wait" in func.__name__:
        return None
    group = next((a for a in reversed(args) if isinstance(a, str) and a in dims), None)
    if group is None:
        group = next((a for a in reversed(args) if isinstance(a, str)), "?")
    first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
    shape = f"{str(first.dtype).replace('torch.', '')}{list(first.shape)}" if isinstance(first, torch.Tensor) else "?"
    count = f" x{len(args[0])}" if isinstance(args[0], (list, tuple)) else ""
    return f"{func.__name__.split('.')[0]} over {dims.get(group, 'group ' + group)} of {shape}{count}"


class CollectiveOrderCheck(TorchDispatchMode):
    """``dims``: c10d group name -> mesh dimension (``timeline.group_dims``); ``label``: where, in the
    message (e.g. "step 1")."""

    def __init__(self, dims: dict[str, str], label: str = "the checked step",
                 group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.dims, self.label = dims, label
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.count = 0
        self.digest = hashlib.sha256()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while torch.compile traces (else dynamo runs every frame eagerly), on while compiled code runs."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if any(is_traceable_wrapper_subclass(a) for a in tree_leaves((args, kwargs))):
            # a DTensor op (clip_grad_norm_): DTensor dispatches it with this mode on, its collectives checked too
            return NotImplemented
        fp = fingerprint(func, args, self.dims)
        if fp is not None:
            self._compare(fp)
        return func(*args, **(kwargs or {}))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        result = super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            self._compare(END)
        return result

    def _compare(self, fp: str) -> None:
        self.count += 1
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, fp, group=self.group)
        if any(other != fp for other in everyone):
            raise CollectiveOrderError(describe(everyone, self.count, self.label))
        self.digest.update(fp.encode())

    def summary(self) -> str:
        """What was checked, for the log: the count and the sequence's hash (equal on every rank)."""
        digest = self.digest.hexdigest()[:16]
        return f"{self.count - 1} collectives in {self.label} identical on every rank (sha256 {digest})"


def describe(everyone: list[str], index: int, label: str) -> str:
    """One line: the first rank that differs from rank 0 at collective ``index``, and what each issues."""
    rank = next(r for r, other in enumerate(everyone) if other != everyone[0])
    return (f"collective order differs across ranks in {label} at collective #{index}: rank 0 issues {everyone[0]}, "
            f"rank {rank} issues {everyone[rank]}; every rank must run the same graphs (compile caches, layouts, "
            f"per-rank conditions); stopped before it could hang")

