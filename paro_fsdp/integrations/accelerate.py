"""Accelerate, the Hugging Face ``Trainer`` and TRL on PaRO: one switch (extra ``paro-fsdp[hf]``).

    from paro_fsdp.integrations.accelerate import use_paro
    use_paro("IIG", group_size=8)    # once, before Accelerator(...) / Trainer(...) / SFTTrainer(...)

Everything else is accelerate's FSDP2 as configured (``fsdp_version=2``; ``TrainingArguments(fsdp=
"full_shard", fsdp_config={"version": 2})``): what changes is who shards. After sharding the model
keeps FSDP2's contract, so ``accumulate`` (``set_requires_gradient_sync``), ``clip_grad_norm_``
over DTensors, ``save_state`` / ``load_state`` (DCP) and ``get_state_dict`` run as they are.

Why the hook is where it is: accelerate's ``fsdp2_prepare_model`` imports ``fully_shard`` from
``torch.distributed.fsdp`` each time it runs and offers no way to pass another. So the switch wraps
that one function and, only while it runs, puts PaRO's ``fully_shard`` there: a script's own
``fully_shard`` elsewhere stays torch's. PaRO's modules are ``FSDPModule``s, so accelerate's and
the Trainer's ``isinstance`` checks hold.

The mesh: a ``ParallelismConfig``'s (dp_replicate, dp_shard) mesh is PaRO's (across groups, inside
a group); otherwise ``init_paro_mesh(group_size)``, by default one group per node.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch.distributed as dist
import torch.nn as nn

from .. import fully_shard, init_paro_mesh
from ..api import is_auto
from ..strategy import PolicyLike, Strategy

__all__ = ["use_paro", "disable_paro", "paro_settings"]

ENV_STRATEGY, ENV_GROUP_SIZE = "PARO_FSDP_STRATEGY", "PARO_FSDP_GROUP_SIZE"


@dataclass(frozen=True)
class ParoSettings:
    """What ``use_paro`` chose: read at each ``Accelerator.prepare``."""

    strategy: PolicyLike
    group_size: Optional[int]
    memory_budget: Optional[float]
    cluster: Any


_settings: Optional[ParoSettings] = None
_original: Optional[Callable[..., nn.Module]] = None  # accelerate's own fsdp2_prepare_model


def use_paro(strategy: Optional[PolicyLike] = None, group_size: Optional[int] = None, *,
             memory_budget: Optional[float] = None, cluster: Any = None) -> ParoSettings:
    """Make accelerate's FSDP2 plugin shard with PaRO from now on; call again to change.

    ``strategy``: "IIG" (default, or ``$PARO_FSDP_STRATEGY``), any of the 27, a ``Strategy``, a policy,
    or "auto" (within ``memory_budget`` bytes per rank; ``cluster``: a preset, file or ``Cluster``, None
    to measure). ``group_size``: without a ``ParallelismConfig`` (default ``$PARO_FSDP_GROUP_SIZE``,
    else ``LOCAL_WORLD_SIZE``)."""
    global _settings
    strategy = strategy if strategy is not None else os.environ.get(ENV_STRATEGY, "IIG")
    if isinstance(strategy, str) and not is_auto(strategy):
        Strategy.parse(strategy)  # an unknown name stops here, with the fix
    if not is_auto(strategy) and (memory_budget is not None or cluster is not None):
        raise ValueError(f"use_paro: memory_budget= and cluster= are read only by strategy=\"auto\" (got "
                         f"{strategy!r}); drop them or pass strategy=\"auto\"")
    if group_size is None and os.environ.get(ENV_GROUP_SIZE):
        group_size = _positive(os.environ[ENV_GROUP_SIZE], f"${ENV_GROUP_SIZE}")
    elif group_size is not None:
        group_size = _positive(group_size, "group_size")
    _settings = ParoSettings(strategy, group_size, memory_budget, cluster)
    _install()
    return _settings


def disable_paro() -> None:
    """Give accelerate's FSDP2 plugin back to torch's ``fully_shard`` (models already sharded stay PaRO's)."""
    global _settings, _original
    _settings = None
    if _original is not None:
        for module in _accelerate_modules():
            if getattr(module, "fsdp2_prepare_model", None) is _prepare_with_paro:
                module.fsdp2_prepare_model = _original
        _original = None


def paro_settings() -> Optional[ParoSettings]:
    """The switch's settings, or None while accelerate shards with torch's FSDP2."""
    return _settings


def _accelerate_modules() -> list[Any]:
    """Where accelerate looks ``fsdp2_prepare_model`` up: its definition (first), the ``accelerate.utils``
    re-export, and ``accelerate.accelerator``'s own import of it (the one ``prepare`` calls)."""
    import accelerate.accelerator
    import accelerate.utils
    import accelerate.utils.fsdp_utils

    return [accelerate.utils.fsdp_utils, accelerate.utils, accelerate.accelerator]


def _install() -> None:
    """Wrap accelerate's ``fsdp2_prepare_model`` once (a second ``use_paro`` only changes settings)."""
    global _original
    if _original is not None:
        return
    _original = _accelerate_modules()[0].fsdp2_prepare_model
    for module in _accelerate_modules():
        if getattr(module, "fsdp2_prepare_model", None) is _original:
            module.fsdp2_prepare_model = _prepare_with_paro


def _prepare_with_paro(accelerator: Any, model: nn.Module) -> nn.Module:
    """accelerate's ``fsdp2_prepare_model``, its ``fully_shard`` calls going to PaRO's."""
    settings, original = _settings, _original
    if settings is None or original is None:  # disabled after a reference to this wrapper was taken
        return (original or _accelerate_modules()[0].fsdp2_prepare_model)(accelerator, model)
    _refuse_unsupported(accelerator)
    with _paro_fully_shard(_shard_with(settings, model)):
        return original(accelerator, model)


@contextlib.contextmanager
def _paro_fully_shard(shard: Callable[..., Any]) -> Iterator[None]:
    """The one place torch's namespace is patched, only for the duration of accelerate's prepare."""
    import torch.distributed.fsdp as torch_fsdp

    saved = torch_fsdp.fully_shard
    torch_fsdp.fully_shard = shard
    try:
        yield
    finally:
        torch_fsdp.fully_shard = saved


def _shard_with(settings: ParoSettings, root: nn.Module) -> Callable[..., Any]:
    """The ``fully_shard`` accelerate calls. Under "auto" only the call on ``root`` shards (the plan
    covers the whole model at once)."""
    auto = is_auto(settings.strategy)

    def shard(module: Union[nn.Module, list[nn.Module]], *, mesh: Any = None, **kwargs: Any) -> Any:
        if auto and module is not root:
            return module
        extra = {"memory_budget": settings.memory_budget, "cluster": settings.cluster} if auto else {}
        return fully_shard(module, mesh=_mesh(mesh, settings), strategy=settings.strategy, **kwargs, **extra)

    return shard


def _mesh(given: Any, settings: ParoSettings) -> Any:
    """accelerate's (dp_replicate, dp_shard) mesh as it is; else the PaRO mesh of ``group_size``."""
    if given is not None and given.ndim == 2:
        if settings.group_size is not None and settings.group_size != given.size(1):
            raise ValueError(f"use_paro(group_size={settings.group_size}) but the ParallelismConfig's dp_shard_size "
                             f"is {given.size(1)}: the groups are its dp_shard; drop group_size or make them equal")
        return given
    world = dist.get_world_size()
    if given is not None and given.size() != world:
        raise ValueError(f"use_paro: accelerate's FSDP mesh has {given.size()} of {world} ranks; PaRO shards over "
                         f"every data-parallel rank: leave tp_size, cp_size and sp_size at 1")
    group = settings.group_size or _positive(os.environ.get("LOCAL_WORLD_SIZE") or world, "$LOCAL_WORLD_SIZE")
    if world % group:
        raise ValueError(f"use_paro: group_size {group} does not divide the world size {world}: pass use_paro("
                         f"group_size=...) with one of {[d for d in range(1, world + 1) if world % d == 0]}")
    return init_paro_mesh(group)


def _refuse_unsupported(accelerator: Any) -> None:
    """accelerate settings PaRO cannot honour stop here with the fix, before any sharding."""
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and any(getattr(pc, f"{k}_enabled", False) for k in ("tp", "cp", "sp")):
        raise NotImplementedError("use_paro: PaRO is data parallelism only; set tp_size, cp_size and sp_size to 1 "
                                  "in the ParallelismConfig, or disable_paro()")
    if accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
        raise NotImplementedError("use_paro: cpu_ram_efficient_loading is not supported; set it to False (for models "
                                  "too large for each rank's CPU, see paro_fsdp.integrations.hf)")


def _positive(value: Any, what: str) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        out = 0
    if out < 1 or isinstance(value, bool) or (isinstance(value, float) and value != out):
        raise ValueError(f"use_paro: {what} must be a positive integer (ranks per group), got {value!r}")
    return out

