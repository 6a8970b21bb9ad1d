"""``fully_shard``: FSDP2's API and calling pattern (each block, then the root), with a strategy.

Why FSDP2's: our users' scripts are written against it (docs/fsdp2.md). A call on a module holding
earlier-sharded modules adopts them as its blocks, so the root's call leaves one engine for the model.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from .api import _auto, _default_blocks, build, is_auto
from .mesh import device_type_for_backend
from .mixed_precision import MixedPrecision
from .module import ParoModule
from .strategy import PolicyLike, resolve_policy


def _outside_meta_default(fn: Callable[..., Any]) -> Callable[..., Any]:
    """FSDP2's meta-device idiom calls ``fully_shard`` under ``torch.device("meta")``: the engine's own small
    tensors (row arithmetic, index tables) must not become meta tensors there."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.get_default_device().type != "meta":
            return fn(*args, **kwargs)
        with torch.device("cpu"):
            return fn(*args, **kwargs)
    return call


@_outside_meta_default
def fully_shard(module: Union[nn.Module, list[nn.Module]], *, mesh: Optional[DeviceMesh] = None,
                strategy: Optional[PolicyLike] = None, reshard_after_forward: Optional[bool] = None,
                shard_placement_fn: Any = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), inter_dtype: Optional[str] = None,
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: Any = None, memory_budget: Optional[float] = None, workload: Any = None,
                cluster: Any = None) -> Union[nn.Module, list[nn.Module]]:
    """Shard ``module`` in place, as ``torch.distributed.fsdp.fully_shard``, and return it.

    ``module``: a module, or a list of modules sharded as one group (FSDP2's). ``mesh``: 1D (one group)
    or 2D (dim 0 across groups, dim 1 inside one); default, one 1D mesh over the world for every call.
    ``reshard_after_forward``: FSDP2's (``None``: a block reshards, the root keeps its parameters
    unsharded until backward). ``strategy``: the P, G, OS levels, as ``paro_shard``'s policy; default,
    FSDP2's layout on that mesh (GGG on 1D, III on 2D). ``mp_policy``: torch's ``MixedPrecisionPolicy``;
    the parameters stay fp32, as FSDP2's. ``inter_dtype`` ("int8", "int4"; PaRO's own): what crosses
    between groups travels quantized; None, the default, is exact.

    ``strategy="auto"`` (with ``memory_budget=``, ``workload=``, ``cluster=``, as ``paro_shard``'s) plans
    the whole model at once: one call on the root, no ``fully_shard`` on its blocks before it.
    """
    modules = _modules_of(module)
    _refuse_unsupported(reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, ignored_params)
    mesh = mesh if mesh is not None else _world_mesh()
    if strategy is None:
        strategy = "GGG" if mesh.ndim == 1 else "III"
    if len(modules) > 1 or module is not modules[0]:
        if is_auto(strategy):
            raise ValueError("fully_shard(strategy=\"auto\") plans a whole model: call it on the root module, not on "
                             "a list of modules")
        fully_shard_group(modules, mesh, strategy, reshard_after_forward, _mixed_precision(mp_policy, inter_dtype))
        return module
    mp = _mixed_precision(mp_policy, inter_dtype)
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
    strategy = _auto(module, mesh, strategy, blocks, mp, memory_budget, workload, cluster,
                     reshard_after_forward is not False, 0,
                     "fully_shard(model, strategy=\"auto\", memory_budget=...) on the root")
    taken = {id(p) for st in adopted for g in st.groups for p in g.sharded_params}
    own = [(n, p) for n, p in module.named_parameters() if id(p) not in taken]
    _refuse_dtensors(own)
    strategies = resolve_policy(strategy, own) if own else {}
    build(module, mesh, strategies, blocks, mp, {}, reshard_after_forward, param_init_fn=_uninitialised,
          adopted=adopted)
    _await_to_empty(module, adopted, own)
    return module


def _await_to_empty(module: nn.Module, adopted: list[Any], named: list[tuple[str, nn.Parameter]]) -> None:
    """Meta tensors hold no values until ``to_empty``: a forward before it stops, as FSDP2's does."""
    meta = {n for n, p in named if p.is_meta}
    earlier = {id(g) for st in adopted for g in st.groups}
    for g in module._paro_state.groups:
        for p in g.params if id(g) not in earlier else ():
            p.unset = p.fqn in meta


def _uninitialised(name: str, tensor: torch.Tensor) -> None:
    """A meta parameter becomes uninitialised memory, as FSDP2's ``model.to_empty``: the model's own init
    (``reset_parameters``, ``init_weights``) then writes the sharded parameters in place."""


def fully_shard_group(modules: list[nn.Module], mesh: DeviceMesh, strategy: PolicyLike,
                      reshard_after_forward: Optional[bool], mp: MixedPrecision) -> None:
    """A list of modules as one block (a tied parameter once), hooked on each; the root's call adopts it."""
    holder = nn.ModuleList(modules)  # names for the parameters until the root renames them; not kept
    adopted = [s for m in modules for s in _sharded_inside(m)]
    if adopted:
        raise ValueError("fully_shard on a list of modules: a module of the list holds modules sharded by earlier "
                         "calls; shard the list's modules whole, or shard the inner ones in the list")
    _refuse_dtensors(list(holder.named_parameters()))
    strategies = resolve_policy(strategy, list(holder.named_parameters()))
    build(holder, mesh, strategies, [], mp, {}, reshard_after_forward,
          param_init_fn=_uninitialised, root_hooks_on=modules)
    _await_to_empty(modules[0], [], list(holder.named_parameters()))


def _refuse_dtensors(named: list[tuple[str, nn.Parameter]]) -> None:
    """Refuses tensor-parallel DTensors and weights an earlier call sharded (tied across calls, as FSDP2)."""
    for name, p in named:
        if getattr(p, "_paro_sharded", False):
            raise ValueError(f"fully_shard: parameter {name} is already managed by another fully_shard call (a "
                             f"weight tied to a module an earlier call sharded): shard the modules sharing it in "
                             f"one call, fully_shard([a, b]), or leave both to their common parent's call")
        if isinstance(p, DTensor):
            raise NotImplementedError(f"fully_shard: parameter {name} is already a DTensor (tensor parallel?): "
                                      f"paro_fsdp shards plain parameters on a 1D or 2D data-parallel mesh only; use "
                                      f"torch's fully_shard for FSDP + TP")


def _modules_of(module: Any) -> list[nn.Module]:
    if isinstance(module, nn.Module):
        return [module]
    if isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
        if len({id(m) for m in module}) != len(module):
            raise ValueError("fully_shard: the list names a module twice")
        return list(module)
    raise TypeError(f"fully_shard takes an nn.Module or a non-empty list of them, got {type(module).__name__}")


def _mixed_precision(mp_policy: MixedPrecisionPolicy, inter_dtype: Optional[str]) -> MixedPrecision:
    return MixedPrecision(param_dtype=mp_policy.param_dtype or torch.float32, reduce_dtype=mp_policy.reduce_dtype,
                          cast_forward_inputs=mp_policy.cast_forward_inputs, inter_dtype=inter_dtype,
                          output_dtype=mp_policy.output_dtype)


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
    """FSDP2's default mesh, one per process group: every ``mesh=None`` call of a model gets the same one."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: no process group: call torch.distributed.init_process_group() first, "
                           "or pass mesh=init_device_mesh(...)")
    key = (dist.group.WORLD, dist.get_world_size())
    if key not in _WORLD_MESHES:
        _WORLD_MESHES.clear()  # a new process group: the old mesh's groups are gone
        _WORLD_MESHES[key] = init_device_mesh(device_type_for_backend(dist.get_backend()), (dist.get_world_size(),))
    return _WORLD_MESHES[key]


_WORLD_MESHES: dict[tuple, DeviceMesh] = {}


def _refuse_unsupported(reshard_after_forward: Any, shard_placement_fn: Any, mp_policy: MixedPrecisionPolicy,
                        offload_policy: OffloadPolicy, ignored_params: Any) -> None:
    """FSDP2 options PaRO cannot honour stop here with the fix, rather than being ignored."""
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: PaRO reshards to its P level, not to a "
                         f"smaller mesh; pass True, False or None (a strategy with P = I keeps a group's copy)")
    if shard_placement_fn is not None:
        raise NotImplementedError("shard_placement_fn: PaRO shards dim 0 at each tensor's level; choose levels with "
                                  "strategy= (a dict of patterns or a callable per parameter)")
    if type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError("offload_policy: CPU offload is not supported by paro_fsdp; leave it at its default")
    if ignored_params:
        raise NotImplementedError("ignored_params: not supported; set requires_grad=False on frozen parameters "
                                  "(they are sharded at their P level) or keep the module out of fully_shard")
