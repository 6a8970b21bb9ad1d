"""``ParoModule``: FSDP2's module methods, with PaRO's meaning, mixed into each sharded module.

Why a mix-in, as FSDP2's ``FSDPModule``: a user's script calls these on the model and on its
blocks (``model.set_requires_gradient_sync(False)``, ``block.unshard()``), so they must be
methods of the modules themselves. The root holds the model-wide state (``_paro_state``); a block
module also holds its own ``ParoBlock`` (``_paro_block``), so a call on it reaches its groups and,
with ``recurse``, those of the blocks inside it.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .collectives import CommStats
from .mesh import MeshGroups
from .overlap import boundary_bytes, push_bytes, push_dims
from .param_group import ParoParamGroup
from .state import ParoBlock, ParoState
from .strategy import Level, Strategy
from .traced import compile_block


class ParoModule:
    """Mixed into the sharded model's class and each ``fully_shard``-ed block's class (as FSDP2
    mixes ``FSDPModule``); the class keeps its name, so exports name the model's own class."""

    _paro_state: ParoState

    # ---- scope: which parameter groups a call reaches -----------------------------------
    def _paro_blocks(self, recurse: bool = True) -> list[ParoBlock]:
        state = self._paro_state
        own: ParoBlock | None = getattr(self, "_paro_block", None)
        if own is None or own.is_root:
            return list(state.blocks) if recurse else [b for b in state.blocks if b.is_root]
        if not recurse:
            return [own]
        inside = {id(m) for m in own.module.modules()}
        return [b for b in state.blocks if not b.is_root and id(b.module) in inside]

    def _paro_groups(self, recurse: bool = True) -> list[ParoParamGroup]:
        return [g for b in self._paro_blocks(recurse) for g in b.groups]

    # ---- FSDP2's methods --------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: the next backwards keep their gradients at the G level (summed over
        micro-steps, no traffic to the OS level); ``True`` (the default, as FSDP2 reduces every
        backward): the next backward also reduces them to the OS level, starting as each block's
        gradient is final, under the rest of backward, into the parameters' ``.grad``. Mark the
        last micro-step with it: that is where PaRO's once-per-step traffic hides."""
        _set_sync_flag(self._paro_groups(recurse), "requires_sync", requires_gradient_sync)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Model-wide (as FSDP2's, a root setting): ``False`` keeps the gradients at the G level
        like ``set_requires_gradient_sync(False)``; a backward reduces to the OS level only when
        both are True."""
        _set_sync_flag(self._paro_state.groups, "is_last", is_last_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the gathered parameters after forward (and gather again in backward), as FSDP2;
        the root's stay gathered until the end of backward, and P = N has nothing to free."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool (PaRO has no smaller mesh to reshard to), "
                             f"got {reshard_after_forward!r}")
        for g in self._paro_groups(recurse):
            g.reshard_after_forward = reshard_after_forward and g.strategy.p != Level.N

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: keep the gathered parameters after backward, for the next forward (as FSDP2,
        for micro-steps without gradient sync); an optimizer step frees them, as stale."""
        for g in self._paro_groups(recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def unshard(self, async_op: bool = False) -> None:
        """Gather this module's P-level parameters now (the forward then finds them gathered);
        ``async_op=True`` only issues the gathers, which the forward waits for. The module's
        parameters stay the OS-level DTensors: the whole tensors are swapped in by the forward."""
        state = self._paro_state
        state.refresh_params()
        for g in self._paro_groups(recurse=False):
            state.land_push(g)
            g.issue_unshard() if async_op else g.unshard()

    def reshard(self) -> None:
        """Free this module's gathered parameters."""
        for g in self._paro_groups(recurse=False):
            g.reshard()

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """The blocks whose gathers this block's forward issues ahead (FSDP2's explicit prefetch)."""
        self._paro_blocks(recurse=False)[0].forward_prefetch = self._blocks_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """The blocks whose gathers this block's backward issues ahead."""
        self._paro_blocks(recurse=False)[0].backward_prefetch = self._blocks_of(modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the gradient summed over ranks (and micro-steps) by ``factor`` instead of the
        world size, as FSDP2's (``1.0``: the plain sum, for a loss already divided by the global
        token count, as torchtitan's). On the root it sets every block; on a block, its own."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for g in self._paro_groups(recurse=self._paro_blocks(recurse=False)[0].is_root):
            g.grad_divide_factor = float(factor)

    def _blocks_of(self, modules: Iterable[nn.Module]) -> list[ParoBlock]:
        by_module = {id(b.module): b for b in self._paro_state.blocks}
        out = []
        for m in modules:
            block = getattr(m, "_paro_block", None) or by_module.get(id(m))
            if block is None:
                raise ValueError(f"{type(m).__name__} is not a sharded block of this model: pass modules given to "
                                 f"fully_shard (or blocks of paro_shard)")
            out.append(block)
        return out

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch's ``nn.Module.compile``, made right for a sharded block: the block's hooks go
        into its graph (``traced.compile_block``), so the gather is a graph node and
        ``reshard_after_forward`` holds (backward re-gathers). torch's own compiles
        ``_call_impl``, a frame dynamo skips: the gathered tensors became a graph input, kept from
        forward to backward. The root (whose parameters stay gathered anyway) compiles as torch's."""
        own = getattr(self, "_paro_block", None)
        if own is None or own.is_root:
            return super().compile(*args, **kwargs)
        if args:
            raise TypeError("compile() of a sharded block: pass torch.compile's options by keyword "
                            "(backend=..., fullgraph=...)")
        compile_block(self, **kwargs)

    # ---- PaRO's own -------------------------------------------------------------------------
    def comm_stats(self) -> CommStats:
        """Collectives issued so far: count and ring bytes per rank per (kind, mesh dim); the
        pushes of the last step still queued are issued first."""
        self._paro_state.pushes.finish()
        return self._paro_state.comm.stats

    def memory_report(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank holds: ``P``, ``G`` (the accumulator: held while gradients accumulate
        unsynced and during a syncing backward, freed once their sum is in ``.grad``), ``OS`` (the
        fp32 parameters, with the optimizer's states when given) and their ``total``, the peak of
        the three; what the boundary adds for a while: ``master_grads`` (the parameters' fp32
        ``.grad``, until ``zero_grad``), ``boundary`` (the largest full-size temporaries of G = N or
        P = N groups) and ``in_flight`` (what overlap keeps alive: the second block of gradient
        reductions in flight with the boundary's queue, or the pushes' queue, each within its
        bound); ``peak`` = total + master_grads + boundary + in_flight."""
        total: Counter[str] = Counter()
        for g in self._paro_state.groups:
            total.update(g.memory_bytes(optimizer.state if optimizer is not None else None))
        report = {k: total[k] for k in ("P", "G", "OS")}
        report["total"] = sum(report.values())
        report["master_grads"] = total["master_grads"]
        report["boundary"] = max(total["boundary_grads"], total["boundary_params"])
        report["in_flight"] = in_flight_bytes(self._paro_state)
        report["peak"] = report["total"] + report["master_grads"] + report["boundary"] + report["in_flight"]
        return report

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` into the sharded parameters; values may be DTensors or
        whole plain tensors (each rank keeps its shard). The working copies follow at the next
        forward (the parameters' versions changed)."""
        if assign:
            raise ValueError("sharded models load in place: assign=True would replace the sharded DTensor parameters")
        # which parameters a load reaches is seen at their owning modules: a parent's pre-hook may
        # rename or merge keys on the way down (torchtitan's fused wqkv), so top-level keys do not say
        owned, owner_modules = _owners(self._paro_state.groups, trainable_only=False)

        def at_owner(module, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
            for attr, param in owned.get(id(module), ()):
                value = sd.get(prefix + attr)
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == param.shape:
                    sd[prefix + attr] = _local_like(param, value)

        handles = [m.register_load_state_dict_pre_hook(at_owner) for m in owner_modules.values()]
        try:
            return super().load_state_dict(state_dict, strict=strict)
        finally:
            for h in handles:
                h.remove()

    def wait_for_params(self) -> None:
        """Land the working copies' refresh now (it is otherwise waited by the next forward)."""
        self._paro_state.refresh_params()
        self._paro_state.pushes.finish()

    def paro_strategies(self) -> dict[str, Strategy]:
        return {ref.fqn: g.strategy for g in self._paro_state.groups for ref in g.refs}

    def paro_mesh_groups(self) -> MeshGroups:
        """The mesh's sizes and c10d group names (plain data): what the graph passes need to
        tell an intra collective from an inter or global one (``passes.install(meshes=...)``)."""
        return self._paro_state.info.groups


def _set_sync_flag(groups: Iterable[ParoParamGroup], flag: str, value: bool) -> None:
    for g in groups:
        setattr(g, flag, bool(value))
        if g.last_backward and g.trainable:  # one compiled graph whatever the step
            g.grad_acc.ensure()


def track_state_dict_writes(groups: Iterable[ParoParamGroup]) -> None:
    """``state_dict()`` values that share the parameters' version counters: ``nn.Module`` saves
    ``param.detach()``, and a DTensor's detach gives its local tensor a counter of its own, so a
    load written into them in place (``dcp.load(model.state_dict())``) went unseen and the working
    copies stayed stale. A DTensor over the parameter's own local tensor (detached: plain tensors
    share the counter) is seen by ``refresh_params``."""
    owned, modules = _owners(groups, trainable_only=True)

    def hook(module, sd, prefix, local_metadata) -> None:
        for attr, param in owned.get(id(module), ()):
            value = sd.get(prefix + attr)
            if isinstance(value, DTensor) and value is not param:  # keep_vars=True hands the parameter itself
                sd[prefix + attr] = DTensor.from_local(param._local_tensor.detach(), param.device_mesh,
                                                       param.placements,
                                                       run_check=False, shape=param.shape, stride=param.stride())

    for key, module in modules.items():
        module.register_state_dict_post_hook(hook)


def _owners(groups: Iterable[ParoParamGroup], trainable_only: bool) -> tuple[dict[int, list], dict[int, nn.Module]]:
    """id(module) -> [(attribute, parameter)] for the modules that own the groups' parameters
    (a tied weight has several owners), and the modules by id."""
    owned: dict[int, list[tuple[str, nn.Parameter]]] = {}
    modules: dict[int, nn.Module] = {}
    for g in groups:
        for p in g.params:
            if p.trainable or not trainable_only:
                for module, attr in p.ref.owners:
                    owned.setdefault(id(module), []).append((attr, p.param))
                    modules[id(module)] = module
    return owned, modules


def _local_like(param: DTensor, whole: torch.Tensor) -> DTensor:
    """A whole tensor as this rank's shard of ``param`` (its mesh and placements), so
    nn.Module's in-place copy into the DTensor parameter works; no communication."""
    local = whole.detach().to(device=param.to_local().device, dtype=param.dtype)
    return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)


def in_flight_bytes(state: ParoState) -> int:
    """The most ``overlap`` and the reductions' slack keep alive at once (``memory_report``)."""
    def grad_buffer(g: ParoParamGroup) -> int:  # a G-level reduction's input, FULL or NESTED
        return g.t_layout.numel(Level.N) * g.mp.grad_dtype.itemsize if g.trainable and g.strategy.g != Level.N else 0

    slack = max((sum(grad_buffer(g) for g in b.groups) for b in state.blocks), default=0)
    boundary = min(state.boundary.limit_bytes,
                   sum(boundary_bytes(g) for g in state.groups if g.trainable and state.info.n > 1))
    pushes = min(state.pushes.limit_bytes, sum(push_bytes(g) for g in state.groups if push_dims(g)))
    return max(slack + boundary, pushes)


def mix_in(module: nn.Module) -> None:
    """Give ``module`` the methods above; its class keeps its name, module and qualname (an HF
    export writes ``type(model).__name__`` into ``architectures``)."""
    cls = module.__class__
    if isinstance(module, ParoModule):
        return
    if cls not in _MIXED:  # one class per original class, as FSDP2's
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _MIXED[cls] = type(cls.__name__, (ParoModule, cls), names)
    module.__class__ = _MIXED[cls]


_MIXED: dict[type, type] = {}
