"""``ParoModule``: FSDP2's module methods, with PaRO's meaning, mixed into each sharded module.

Why a mix-in, as FSDP2's ``FSDPModule``: a user's script calls these on the model and on its
blocks (``model.set_requires_gradient_sync(False)``, ``block.unshard()``), so they must be
methods of the modules themselves. The root holds the model-wide state (``_paro_state``); a block
module also holds its own ``ParoBlock`` (``_paro_block``), so a call on it reaches its groups and,
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
    """Mixed into the sharded model's class and each ``fully_shard``-ed block's class (as FSDP2
    mixes ``FSDPModule``); the class keeps its name, so exports name the model's own class.

    Why a subclass of torch's ``FSDPModule``: FSDP2's clients (accelerate, transformers' Trainer,
    TRL, torch's ``register_fsdp_forward_method``) test ``isinstance(m, FSDPModule)`` to pick
    their FSDP2 paths. Every public method of it is overridden here with PaRO's meaning, or refused
    in one line (``_refuse_the_rest``): none reaches FSDP2's state, which these modules do not have."""

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
        """``False``: the next backwards keep their gradients at the G level (summed over
        micro-steps, no traffic to the OS level); ``True`` (the default, as FSDP2 reduces every
        backward): the next backward also reduces them to the OS level, starting as each block's
        gradient is final, under the rest of backward, into the parameters' ``.grad``. Mark the
        last micro-step with it: that is where PaRO's once-per-step traffic hides."""
        _set_sync_flag(self._paro_groups(recurse), "requires_sync", requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's HSDP switch, accumulation with the intra-group reduction only. PaRO's meaning:
        ``False`` keeps the gradients at the G level (the inter-group traffic waits for a backward
        with it True), as ``set_requires_gradient_sync(False)``; ``.grad`` is written by that
        backward, where HSDP writes a partial sum each time."""
        _set_sync_flag(self._paro_groups(recurse), "requires_all_reduce", requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Model-wide (as FSDP2's, a root setting): ``False`` keeps the gradients at the G level
        like ``set_requires_gradient_sync(False)``; a backward reduces to the OS level only when
        both are True."""
        _set_sync_flag(self._paro_state.groups, "is_last", is_last_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the gathered parameters after forward (and gather again in backward), as FSDP2;
        ``False`` keeps them, registered on the modules. The root's stay gathered until the end of
        backward either way, and P = N has nothing to free."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool (PaRO has no smaller mesh to reshard to), "
                             f"got {reshard_after_forward!r}")
        for b in self._paro_blocks(recurse):
            b.reshard_after_forward = reshard_after_forward
            for g in b.groups:
                g.reshard_after_forward = reshard_after_forward and not g.plan.params_whole

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: keep the gathered parameters after backward, for the next forward (as FSDP2,
        for micro-steps without gradient sync); an optimizer step frees them, as stale."""
        for g in self._paro_groups(recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's P-level parameters now and register the whole tensors on its
        modules (FSDP2's unsharded parameters: a call into the module before its forward works);
        ``async_op=True`` only issues the gathers and returns a handle whose ``wait()`` finishes
        them (the forward also waits)."""
        state = self._paro_state
        state.refresh_params()
        groups = self._paro_groups(recurse=False)
        for g in groups:
            state.land_push(g)
            g.issue_unshard()
        handle = _UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters; its sharded parameters are registered again."""
        for g in self._paro_groups(recurse=False):
            g.reshard()

    def reset_iter_state(self) -> None:
        """After an exception inside forward or backward, on the root: land the collectives in
        flight, reshard, drop the aborted iteration's gradients (and unsynced accumulated ones)."""
        if not self._paro_blocks(recurse=False)[0].is_root:
            raise RuntimeError("reset_iter_state() must be called on the root module (the last fully_shard call's)")
        self._paro_state.reset_iter_state()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: this module's backward does not gather its parameters (FSDP2's expert switch,
        for parameters its backward never reads, such as an embedding's)."""
        for b in self._paro_blocks(recurse=False):
            b.unshard_in_backward = bool(unshard_in_backward)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """FSDP2's: the next forward's gathers wait on ``event``. PaRO's gathers also wait for its
        own push of the step's parameters (issued by the optimizer's step hook), so the event adds
        an ordering and removes none."""
        self._paro_state.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 for ``set_gradient_divide_factor``."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: PaRO's gradient collectives always sum, and divide afterwards."""

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted: a parameter with no gradient is always reduced as zeros (every rank issues the
        same collectives), FSDP2's ``True``."""

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """The blocks whose gathers this block's forward issues ahead (FSDP2's explicit prefetch)."""
        self._paro_blocks(recurse=False)[0].forward_prefetch = self._blocks_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """The blocks whose gathers this block's backward issues ahead."""
        self._paro_blocks(recurse=False)[0].backward_prefetch = self._blocks_of(modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the gradient summed over ranks (and micro-steps) by ``factor`` instead of the
        world size, as FSDP2's (``1.0``: the plain sum, for a loss already divided by the global
        token count, as torchtitan's). As FSDP2's, not recursive: this module's own parameters
        (call it on every sharded module for the whole model, as torchtitan does)."""
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
        """torch's ``nn.Module.compile``, made right for a sharded block: the block's hooks go
        into its graph (``traced._compile_block``), so the gather is a graph node and
        ``reshard_after_forward`` holds (backward re-gathers). torch's own compiles
        ``_call_impl``, a frame dynamo skips: the gathered tensors became a graph input, kept from
        forward to backward. The root (whose parameters stay gathered anyway) compiles as torch's."""
        own = getattr(self, "_paro_block", None)
        if own is None or own.is_root:
            return super().compile(*args, **kwargs)
        if args:
            raise TypeError("compile() of a sharded block: pass torch.compile's options by keyword "
                            "(backend=..., fullgraph=...)")
        _compile_block(self, **kwargs)

    def _get_fsdp_state(self) -> "_ForwardHooks":
        """What torch's ``register_fsdp_forward_method`` calls around a method (``generate``):
        this module's pre- and post-forward. Nothing else of FSDP2's state exists here."""
        return _ForwardHooks(self._paro_blocks(recurse=False)[0])

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``module.to(...)``, ``.float()``, ``.cuda()`` after sharding: the sharded parameters
        are registered first (as FSDP2); a conversion that keeps their dtype and device applies to
        the rest (buffers, unsharded parameters); one that changes them is refused, since the
        engine's flat buffers are built in one dtype on the mesh's device."""
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

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``nn.Module.state_dict`` of the sharded parameters, also while the whole tensors are
        registered (after a forward that keeps them): they are registered back first, as FSDP2's
        state-dict hooks do."""
        self._paro_state.register_sharded()
        return super().state_dict(*args, **kwargs)

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


class _UnshardHandle(UnshardHandle):
    """``unshard(async_op=True)``'s handle: ``wait()`` lands the gathers and registers the whole
    tensors on the modules."""

    def __init__(self, groups: list[ParoParamGroup]) -> None:
        self._groups: list[ParoParamGroup] | None = groups

    def wait(self) -> None:
        for g in self._groups or ():
            g.unshard()
            g.register(g.full_params)
        self._groups = None


class _ForwardHooks:
    """The ``_pre_forward`` / ``_post_forward`` pair torch's ``register_fsdp_forward_method``
    wraps a method in: the block's own forward hooks."""

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
    """Every public ``FSDPModule`` method this torch has and ``ParoModule`` does not define
    (custom collectives, hooks on FSDP2's all-reduce, its buffer and stream settings; any a later
    torch adds) raises, rather than reaching FSDP2's state or doing nothing."""
    for name in dir(FSDPModule):
        if not name.startswith("_") and callable(getattr(FSDPModule, name)) and name not in ParoModule.__dict__:
            setattr(ParoModule, name, _refuse(name))


_refuse_the_rest()


def _set_sync_flag(groups: Iterable[ParoParamGroup], flag: str, value: bool) -> None:
    """Only the flag: the accumulator is allocated by the first backward that needs it, so a
    compiled last micro-step sees it exactly when earlier micro-steps left gradients in it (one
    graph per accumulation pattern; allocating it here made a script that marks the last
    micro-step once recompile at its second step, after the boundary had freed it)."""
    for g in groups:
        setattr(g, flag, bool(value))


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
        return g.t_layout.numel(Level.N) * g.mp.grad_dtype.itemsize if g.trainable and not g.plan.grads_whole else 0

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
