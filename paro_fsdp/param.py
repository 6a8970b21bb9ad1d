"""``ParoParam``: one sharded tensor, as FSDP2's ``FSDPParam``.

Why one object per tensor: its name, owners, layouts, parameter, working copy and whole tensor
belong together; the group keeps the flat buffers they view, so a collective moves a whole bucket.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .layout import TensorLayout


@dataclass
class ParamRef:
    """An original parameter's name, shape and owners. ``source``: the original tensor until its
    group has copied its shards out, then dropped, so the unsharded model is freed (as FSDP2's)."""

    fqn: str
    like: nn.Parameter  # a meta Parameter of the original's shape (no memory), see ``of``
    stride: tuple[int, ...]
    requires_grad: bool
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    source: torch.Tensor | None = None

    @classmethod
    def of(cls, fqn: str, param: nn.Parameter, owners: list[tuple[nn.Module, str]]) -> "ParamRef":
        # a meta Parameter, not ints: dynamo keeps Parameter sizes static, while ints on plain
        # objects turned symbolic when per-block graphs recompiled for the next block
        like = nn.Parameter(torch.empty(param.shape, device="meta"), requires_grad=False)
        return cls(fqn, like, tuple(param.stride()), param.requires_grad, owners, param)

    @property
    def shape(self) -> torch.Size:
        return self.like.shape

    @property
    def numel(self) -> int:
        return self.like.numel()


@dataclass
class ParoParam:
    """One tensor of a group. ``param``: the module's parameter, an fp32 DTensor at the OS level
    (trainable: what the optimizer updates) or at P (frozen: its only copy); ``working``: this
    rank's P-level shard, a view of the group's P storage (the master itself where P = OS);
    ``master``: ``param``'s local tensor (None when frozen); ``whole`` / ``whole_buf``: the whole
    tensor while gathered and its padded buffer (None for P = N, where ``whole`` is ``working``)."""

    ref: ParamRef
    layout: TensorLayout
    working: torch.Tensor
    master: torch.Tensor | None = None
    param: nn.Parameter | None = None
    whole: torch.Tensor | None = None
    whole_buf: torch.Tensor | None = None
    unset: bool = False  # made from a meta tensor by fully_shard: no values until ``to_empty``

    @property
    def fqn(self) -> str:
        return self.ref.fqn

    @property
    def trainable(self) -> bool:
        return self.ref.requires_grad

    def version(self) -> int:
        """Grows with every in-place write: the DTensor's own counter plus its local tensor's (writes
        into ``to_local()``, as DCP's load)."""
        return self.param._version + self.param._local_tensor._version

    def register(self) -> None:
        """Put ``param`` on every module attribute that held the original."""
        for module, attr in self.ref.owners:
            module._parameters[attr] = self.param

    @torch.no_grad()
    def adopt_replaced(self) -> bool:
        """A whole tensor assigned over the parameter after sharding (``model.w = nn.Parameter(...)``,
        as FSDP2's lazy init allows): its rows copied into ``param``, re-registered. False if none."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        module, attr = self.ref.owners[0]
        new = module._parameters.get(attr)
        if not isinstance(new, nn.Parameter) or new is self.param or new.shape != self.ref.like.shape:
            return False  # ours: the sharded parameter, or the whole tensors registered while unsharded
        whole = new.detach().full_tensor() if isinstance(new, DTensor) else new.detach()  # a DTensor: every rank's
        d = self.param
        d.copy_(distribute_tensor(whole.to(d.device, d.dtype), d.device_mesh, d.placements, src_data_rank=None))
        self.register()
        self.unset = False
        return True
