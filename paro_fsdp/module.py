"""``ParoModule``: FSDP2's module methods, with PaRO's meaning, mixed into each sharded module.

A mix-in, as FSDP2's: scripts call these on the model and its blocks. The root holds the
model-wide ``_paro_state``; a block also its ``_paro_block``, so a call reaches its groups and,
with ``recurse``, those of the blocks inside it.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle
from torch.distributed.tensor import DTensor, distribute_tensor

from .collectives import CommStats
from .mesh import MeshGroups
from .overlap import boundary_bytes, push_bytes, push_dims
from .param_group import ParoParamGroup
from .state import ParoBlock, ParoState
from .strategy import Level, Strategy
from .traced import _compile_block


class ParoModule(FSDPModule):
    """Why a subclass of torch's ``FSDPModule``: FSDP2's clients (accelerate, transformers' Trainer,
    TRL, ``register_fsdp_forward_method``) test ``isinstance(m, FSDPModule)``. Every public method
    is overridden with PaRO's meaning or refused (``_refuse_the_rest``): none reaches FSDP2's state."""

    _paro_state: ParoState

    def __new__(cls, *args: Any, **kwargs: Any):
        """As FSDP2's: constructing the class (a container's slice) builds the original class."""
        orig = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

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
        """``False``: the next backwards keep their gradients summed at the G level; ``True`` (the
        default, as FSDP2's): a backward also reduces them to the OS level, under the rest of
        backward, into ``.grad``. Mark the last micro-step: PaRO's once-per-step traffic hides there."""
        _set_sync_flag(self._paro_groups(recurse), "requires_sync", requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's HSDP switch. PaRO's meaning: ``False`` keeps the gradients at the G level, as
        ``set_requires_gradient_sync(False)``; ``.grad`` is written by the next backward with it
        True, where HSDP writes a partial sum each time."""
        _set_sync_flag(self._paro_groups(recurse), "requires_all_reduce", requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Model-wide, as FSDP2's: a backward reduces to the OS level only when this and
        ``set_requires_gradient_sync`` are both True."""
        _set_sync_flag(self._paro_state.groups, "is_last", is_last_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """As FSDP2's; ``False`` keeps them registered on the modules. The root's stay gathered
        until the end of backward either way, and P = N has nothing to free."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool (PaRO has no smaller mesh to reshard to), "
                             f"got {reshard_after_forward!r}")
        for b in self._paro_blocks(recurse):
            b.reshard_after_forward = reshard_after_forward
            for g in b.groups:
                g.reshard_after_forward = reshard_after_forward and not g.plan.params_whole

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """As FSDP2's (micro-steps without sync); an optimizer step frees them, as stale."""
        for g in self._paro_groups(recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather now and register the whole tensors on the modules, as FSDP2's; ``async_op=True``
        returns a handle whose ``wait()`` (or the forward) finishes the gathers."""
        state = self._paro_state
        state.refresh_params()
        groups = self._paro_groups(recurse=False)
        for g in groups:
            state.land_push(g)
            g.issue_unshard()
        handle = _UnshardHandle(groups)
        if not async_op:
            handle.wait()
        return handle if async_op else None

    def reshard(self) -> None:
        """Free this module's gathered parameters; its sharded parameters are registered again."""
        for g in self._paro_groups(recurse=False):
            g.reshard()

    def reset_iter_state(self) -> None:
        """After an exception inside forward or backward, on the root (``ParoState.reset_iter_state``)."""
        if not self._paro_blocks(recurse=False)[0].is_root:
            raise RuntimeError("reset_iter_state() must be called on the root module (the last fully_shard call's)")
        self._paro_state.reset_iter_state()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's expert switch, for parameters backward never reads (an embedding's)."""
        for b in self._paro_blocks(recurse=False):
            b.unshard_in_backward = bool(unshard_in_backward)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's gathers wait on ``event``, as well as on the step's own push."""
        self._paro_state.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 for ``set_gradient_divide_factor``."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: PaRO's gradient collectives always sum, and divide afterwards."""

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted: a parameter with no gradient on this rank is always reduced as zeros, FSDP2's ``True``
        (its ``.grad`` is None after backward where no rank used it, as FSDP2's)."""

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """The blocks whose gathers this block's forward issues ahead (FSDP2's explicit prefetch)."""
        self._paro_blocks(recurse=False)[0].forward_prefetch = self._blocks_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """The blocks whose gathers this block's backward issues ahead."""
        self._paro_blocks(recurse=False)[0].backward_prefetch = self._blocks_of(modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradient by ``factor`` instead of the world size (``1.0``: a loss already
        divided by the global token count, as torchtitan's). Not recursive, as FSDP2's."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for g in self._paro_groups(recurse=False):
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
        """On a block, its hooks go into its graph (``traced._compile_block``), so
        ``reshard_after_forward`` holds: torch's own compiles ``_call_impl``, a frame dynamo skips,
        and the gathered tensors became a graph input kept to backward. The root compiles as torch's."""
        own = getattr(self, "_paro_block", None)
        if own is None or own.is_root:
            return super().compile(*args, **kwargs)
        if args:
            raise TypeError("compile() of a sharded block: pass torch.compile's options by keyword "
                            "(backend=..., fullgraph=...)")
        _compile_block(self, **kwargs)

    def _get_fsdp_state(self) -> "_ForwardHooks":
        """What ``register_fsdp_forward_method`` calls around a method (``generate``)."""
        return _ForwardHooks(self._paro_blocks(recurse=False)[0])

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``module.to(...)`` after sharding: one that would change the sharded parameters' dtype or
        device is refused (the flat buffers are built in one dtype on the mesh's device); the rest
        (buffers, unsharded parameters) convert."""
        state = self._paro_state
        if state.applying:  # a sharded module inside the one being converted: its parameters are hidden already
            return nn.Module._apply(self, fn, recurse)
        state.register_sharded()
        ours = {id(p) for g in state.groups for p in g.sharded_params}
        hidden = []
        for m in self.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) in ours:
                    probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
                    if probe.dtype != p.dtype or probe.device != p.device:
                        raise ValueError(f"{type(self).__name__}.to(...) after sharding would move {name} from "
                                         f"{p.dtype} on {p.device} to {probe.dtype} on {probe.device}: paro_fsdp "
                                         f"keeps fp32 parameters on the mesh's device; convert the model before "
                                         f"fully_shard, or set mp_policy=MixedPrecisionPolicy(param_dtype=...)")
                    hidden.append((m, name, p))
        for m, name, _ in hidden:
            m._parameters[name] = None
        converted = {id(p) for _, _, p in hidden}
        for p in (p for g in state.groups for p in g.params if id(p.param) in converted):
            p.unset = False  # to_empty (or any conversion) gave them memory: the caller initialises them
        state.applying = True
        try:
            return nn.Module._apply(self, fn, recurse)  # past FSDPModule._apply, which reads FSDP2's state
        finally:
            state.applying = False
            for m, name, p in hidden:
                m._parameters[name] = p

    # ---- PaRO's own -------------------------------------------------------------------------
    def comm_stats(self) -> CommStats:
        """Count and ring bytes per (kind, mesh dim) of the collectives issued so far (a step's push
        is issued by the next forward, or by ``wait_for_params()``, which every rank calls)."""
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

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Of the sharded parameters, registered back first, as FSDP2's state-dict hooks do."""
        self._paro_state.register_sharded()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Values may be DTensors or whole plain tensors (each rank keeps its shard)."""
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
        """What the graph passes need to tell the mesh dims apart (``passes.install(meshes=...)``)."""
        return self._paro_state.info.groups


class _UnshardHandle(UnshardHandle):
    """``unshard(async_op=True)``'s handle: ``wait()`` lands the gathers and registers the whole tensors."""

    def __init__(self, groups: list[ParoParamGroup]) -> None:
        self._groups: list[ParoParamGroup] | None = groups

    def wait(self) -> None:
        for g in self._groups or ():
            g.unshard()
            g.register(g.full_params)
        self._groups = None


class _ForwardHooks:
    """The ``_pre_forward`` / ``_post_forward`` pair ``register_fsdp_forward_method`` wraps a method in."""

    def __init__(self, block: ParoBlock) -> None:
        self._block = block

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._block.pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return self._block.post_forward(module, args, {}, output)


def _refuse(name: str) -> Any:
    def refused(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{name}: an FSDP2 setting of its own collectives and buffers, which paro_fsdp "
                                  f"does not have; drop the call (docs/fsdp2.md lists what each FSDP2 method does)")
    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = "Refused in one line: FSDP2's own collectives and buffers (docs/fsdp2.md)."
    return refused


def _refuse_the_rest() -> None:
    """Every public ``FSDPModule`` method ``ParoModule`` does not define (any a later torch adds
    too) raises, rather than reaching FSDP2's state or doing nothing."""
    for name in dir(FSDPModule):
        if not name.startswith("_") and callable(getattr(FSDPModule, name)) and name not in ParoModule.__dict__:
            setattr(ParoModule, name, _refuse(name))


_refuse_the_rest()


def _set_sync_flag(groups: Iterable[ParoParamGroup], flag: str, value: bool) -> None:
    """Only the flag: the first backward that needs the accumulator allocates it, so a compiled
    graph sees one per accumulation pattern (allocated here, it recompiled at the second step)."""
    for g in groups:
        setattr(g, flag, bool(value))


def track_state_dict_writes(groups: Iterable[ParoParamGroup]) -> None:
    """``state_dict()`` values that share the parameters' version counters: a DTensor's detach
    gives its local tensor a counter of its own, so ``dcp.load(model.state_dict())`` went unseen by
    ``refresh_params`` and the working copies stayed stale."""
    owned, modules = _owners(groups, trainable_only=True)

    def hook(module, sd, prefix, local_metadata) -> None:
        for attr, param in owned.get(id(module), ()):
            value = sd.get(prefix + attr)
            if isinstance(value, DTensor) and value is not param:  # keep_vars=True hands the parameter itself
                local = param._local_tensor.detach()
                sd[prefix + attr] = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                                       shape=param.shape, stride=param.stride())

    for key, module in modules.items():
        module.register_state_dict_post_hook(hook)


def _owners(groups: Iterable[ParoParamGroup], trainable_only: bool) -> tuple[dict[int, list], dict[int, nn.Module]]:
    """id(module) -> [(attribute, parameter)] of the owners (a tied weight has several), and the modules."""
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
    """A whole tensor as this rank's shard of ``param``, no communication."""
    local = whole.detach().to(device=param.to_local().device, dtype=param.dtype)
    return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)


def in_flight_bytes(state: ParoState) -> int:
    """The most ``overlap`` and the reductions' slack keep alive at once (``memory_report``)."""
    def grad_buffer(g: ParoParamGroup) -> int:  # a G-level reduction's input, FULL or NESTED
        return g.t_layout.numel(Level.N) * g.mp.grad_dtype.itemsize if g.trainable and not g.plan.grads_whole else 0

    slack = max((sum(grad_buffer(g) for g in b.groups) for b in state.blocks), default=0)
    boundary = min(state.boundary.limit_bytes,
                   sum(boundary_bytes(g) for g in state.groups if g.trainable and state.info.n > 1))
    pushes = min(state.pushes.limit_bytes, sum(push_bytes(g) for g in state.groups if push_dims(g)))
    return max(slack + boundary, pushes)


def mix_in(module: nn.Module) -> None:
    """Its class keeps its name and qualname (an HF export writes it into ``architectures``)."""
    cls = module.__class__
    if isinstance(module, ParoModule):
        return
    if cls not in _MIXED:  # one class per original class, as FSDP2's
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _MIXED[cls] = type(cls.__name__, (ParoModule, cls), names)
    module.__class__ = _MIXED[cls]


_MIXED: dict[type, type] = {}
