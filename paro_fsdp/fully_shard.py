"""``fully_shard``: FSDP2's API and calling pattern (each block, then the root), with a strategy.

Why FSDP2's: our users' scripts are written against it (docs/fsdp2.md). Each call shards the
module's parameters not already sharded, at once; a call on a module that holds earlier-sharded
modules adopts them as its blocks, so the last call, on the root, leaves one engine for the model.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from .api import _auto, _default_blocks, build, is_auto
from .mesh import device_type_for_backend
from .mixed_precision import MixedPrecision
from .module import ParoModule
from .strategy import PolicyLike, resolve_policy


def fully_shard(module: nn.Module, *, mesh: Optional[DeviceMesh] = None, strategy: Optional[PolicyLike] = None,
                reshard_after_forward: bool = True, shard_placement_fn: Any = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: Any = None, memory_budget: Optional[float] = None, workload: Any = None,
                cluster: Any = None) -> nn.Module:
    """Shard ``module`` in place, as ``torch.distributed.fsdp.fully_shard``, and return it.

    ``mesh``: 1D (one group) or 2D (dim 0 across groups, dim 1 inside a group, any names);
    default, a 1D mesh over the world. ``strategy``: the P, G, OS levels ("IIG", a ``Strategy``,
    or a dict of fnmatch patterns over the module's parameter names / a callable, as
    ``paro_shard``'s policy); default, FSDP2's layout on that mesh (GGG on 1D, III on 2D).
    ``mp_policy``: torch's ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``,
    ``cast_forward_inputs``); the parameters themselves stay fp32, as FSDP2's.

    ``strategy="auto"`` (with ``memory_budget=`` bytes per rank, ``workload=``, ``cluster=``, as
    ``paro_shard``'s) plans the whole model at once, so it is one call on the root, with no
    ``fully_shard`` on its blocks before it: the blocks are found as ``paro_shard`` finds them.
    """
    _refuse_unsupported(module, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, ignored_params)
    mesh = mesh if mesh is not None else _world_mesh()
    if strategy is None:
        strategy = "GGG" if mesh.ndim == 1 else "III"
    mp = MixedPrecision(param_dtype=mp_policy.param_dtype or torch.float32, reduce_dtype=mp_policy.reduce_dtype,
                        cast_forward_inputs=mp_policy.cast_forward_inputs)
    adopted = _sharded_inside(module)
    blocks: list[nn.Module] = []
    if is_auto(strategy):
        blocks = _default_blocks(module)
        if adopted or not blocks:
            name = type(module).__name__
            why = "its blocks were sharded by earlier calls" if adopted else f"no blocks in this {name}"
            raise ValueError(f"fully_shard(strategy=\"auto\"): {why}; \"auto\" plans a whole model at once: call it "
                             f"once, on the root (blocks: the elements of its ModuleLists), not on each block, or use "
                             f"paro_shard(model, mesh, \"auto\", memory_budget=...)")
    strategy = _auto(module, mesh, strategy, blocks, mp, memory_budget, workload, cluster, reshard_after_forward, 0,
                     "fully_shard(model, strategy=\"auto\", memory_budget=...) on the root")
    taken = {id(p) for st in adopted for g in st.groups for p in g.sharded_params}
    own = [(n, p) for n, p in module.named_parameters() if id(p) not in taken]
    strategies = resolve_policy(strategy, own) if own else {}
    return build(module, mesh, strategies, blocks, mp, {}, reshard_after_forward, adopted=adopted,
                 root_hooks_on=module)


def _sharded_inside(module: nn.Module) -> list:
    """The engines of modules inside ``module`` sharded by earlier calls (each once)."""
    if isinstance(module, ParoModule):
        raise ValueError(f"fully_shard was already called on this {type(module).__name__}: call it once per module, "
                         f"blocks first, then the root")
    states = []
    for m in module.modules():
        state = getattr(m, "_paro_state", None) if m is not module else None
        if state is not None and all(s is not state for s in states):
            states.append(state)
    return states


def _world_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: no process group: call torch.distributed.init_process_group() first, "
                           "or pass mesh=init_device_mesh(...)")
    return init_device_mesh(device_type_for_backend(dist.get_backend()), (dist.get_world_size(),))


def _refuse_unsupported(module: nn.Module, reshard_after_forward: Any, shard_placement_fn: Any,
                        mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy, ignored_params: Any) -> None:
    """FSDP2 options PaRO cannot honour stop here with the fix, rather than being ignored."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: PaRO reshards to its P level, not to a "
                         f"smaller mesh; pass True or False (a strategy with P = I keeps a group's copy)")
    if shard_placement_fn is not None:
        raise NotImplementedError("shard_placement_fn: PaRO shards dim 0 at each tensor's level; choose levels with "
                                  "strategy= (a dict of patterns or a callable per parameter)")
    if type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError("offload_policy: CPU offload is not supported by paro_fsdp; leave it at its default")
    if ignored_params:
        raise NotImplementedError("ignored_params: not supported; set requires_grad=False on frozen parameters "
                                  "(they are sharded at their P level) or keep the module out of fully_shard")
    if mp_policy.output_dtype is not None:
        raise NotImplementedError("MixedPrecisionPolicy.output_dtype is not supported by paro_fsdp; cast the output")
    if mp_policy.param_dtype == torch.float16:
        raise ValueError("MixedPrecisionPolicy(param_dtype=torch.float16): use torch.bfloat16 (fp16 needs a loss "
                         "scaler, which paro_fsdp does not have)")
