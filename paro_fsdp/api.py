"""``paro_shard``: turn a model into a PaRO data-parallel model on a 2D mesh."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .collectives import CommStats
from .comm import MeshComm
from .mesh import MeshGroups, MeshInfo, mesh_device
from .paro_cc import ParoCC
from .mixed_precision import MixedPrecision
from .overlap import boundary_bytes, push_bytes, push_dims
from .boundary import drive, push_params
from .param_group import ParamRef, ParoParamGroup
from .state import ParoBlock, ParoState
from .traced import make_sinks_on_compile
from .strategy import Level, PolicyLike, Strategy, resolve_policy
from .streams import streams_for


class ParoModule:
    """Mixed into the sharded model's class (as FSDP2 does) to add the engine's methods."""

    _paro_state: ParoState

    def comm_stats(self) -> CommStats:
        """Collectives issued so far: count and ring bytes per rank per (kind, mesh dim); the
        pushes of the last step still queued are issued first."""
        self._paro_state.pushes.finish()
        return self._paro_state.comm.stats

    def memory_report(self, optimizer=None) -> dict[str, int]:
        """Bytes this rank holds: ``P``, ``G`` (the accumulator), ``OS`` (with the optimizer's states
        when given) and their ``total``; what the boundary adds for a while: ``master_grads`` (fp32,
        until ``zero_grad``), ``boundary`` (the largest full-size temporaries of G = N or P = N
        groups) and ``in_flight`` (what overlap keeps alive: the second block of gradient
        reductions in flight with the boundary's queue, or the pushes' queue, each within its
        bound); ``peak`` = total + master_grads + boundary + in_flight."""
        states = optimizer.inner.state if optimizer is not None else None
        total = {"P": 0, "G": 0, "OS": 0, "master_grads": 0, "boundary_grads": 0, "boundary_params": 0}
        for g in self._paro_state.groups:
            for key, value in g.memory_bytes(states).items():
                total[key] += value
        report = {k: total[k] for k in ("P", "G", "OS")}
        report["total"] = total["P"] + total["G"] + total["OS"]
        report["master_grads"] = total["master_grads"]
        report["boundary"] = max(total["boundary_grads"], total["boundary_params"])
        report["in_flight"] = in_flight_bytes(self._paro_state)
        report["peak"] = report["total"] + report["master_grads"] + report["boundary"] + report["in_flight"]
        return report

    def set_is_last_backward(self, is_last: bool) -> None:
        """Whether the next backward is the last micro-step before the optimizer step (as in
        FSDP2): its reductions to the OS level then start as blocks finish, under the rest of
        backward (eager: overlap.py; compiled blocks: inside their backward graph), and
        ``clip_grad_norm_`` / ``step`` wait only for what is still running. Unset, they all run
        at ``clip_grad_norm_`` / ``step``."""
        for g in self._paro_state.groups:
            g.last_backward = bool(is_last)
            if is_last and g.trainable:  # one graph whatever the step
                g.grad_acc.ensure()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the gradient summed over ranks (and micro-steps) by ``factor`` instead of the
        world size, as FSDP2's ``set_gradient_divide_factor`` (``1.0``: the plain sum, for loss
        already divided by the global token count, as torchtitan's). One scale for the model."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor}")
        for g in self._paro_state.groups:
            g.grad_divide_factor = float(factor)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, then the fp32 masters of every loaded parameter take the
        loaded values, or the next step would push the old masters back to P. Values may be
        DTensors or whole plain tensors (exact fp32 masters). The optimizer's moments are left as
        they are: a full resume loads the optimizer's own state too."""
        if assign:
            raise ValueError("paro_shard models load in place: assign=True would replace the sharded DTensor parameters")
        self._paro_state.pushes.finish()
        # which parameters a load reaches is seen at their owning modules: a parent's pre-hook may
        # rename or merge keys on the way down (torchtitan's fused wqkv), so top-level keys do not say
        owned: dict[int, list[tuple[str, ParoParamGroup, int]]] = {}
        owner_modules: dict[int, nn.Module] = {}
        for g in self._paro_state.groups:
            for i, ref in enumerate(g.refs):
                for module, attr in ref.owners:
                    owned.setdefault(id(module), []).append((attr, g, i))
                    owner_modules[id(module)] = module
        loaded: set[str] = set()
        full: dict[str, torch.Tensor] = {}

        def at_owner(module, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
            for attr, group, i in owned.get(id(module), ()):
                value = sd.get(prefix + attr)
                if not torch.is_tensor(value):
                    continue
                ref = group.refs[i]
                if not isinstance(value, DTensor):
                    if value.shape != ref.shape:
                        continue  # nn.Module reports the mismatch
                    full[ref.fqn] = value
                    sd[prefix + attr] = _as_p_level(group, i, value)
                loaded.add(ref.fqn)

        handles = [m.register_load_state_dict_pre_hook(at_owner) for m in owner_modules.values()]
        try:
            result = super().load_state_dict(state_dict, strict=strict)
        finally:
            for h in handles:
                h.remove()
        for g in self._paro_state.groups:
            g.reload_master(loaded, full)
        return result

    def state_dict(self, *args, **kwargs):
        """``nn.Module.state_dict`` after the last step's pushes land (they may still be in flight)."""
        self._paro_state.pushes.finish()
        return super().state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        """``nn.Module.named_parameters`` (and so ``parameters``) after the last step's pushes land."""
        self._paro_state.pushes.finish()
        return super().named_parameters(*args, **kwargs)

    def wait_for_params(self) -> None:
        """Land the last step's pushes now: before reading a parameter held from earlier (its
        ``full_tensor()``), which would otherwise see the values before the step. The next
        forward, ``state_dict``, ``parameters`` and the checkpoint helpers do it themselves."""
        self._paro_state.pushes.finish()

    def master_state_dict(self) -> dict[str, DTensor]:
        """What this run trains from, keyed by parameter name: each trainable parameter's fp32
        master at its OS level, each frozen one's P-level parameter (its only copy), as DTensors
        viewing the engine's storage: DCP writes each rank's shard and loads in place (then call
        ``push_masters``)."""
        return {ref.fqn: g.os_dtensor(g.t_layout.tensors[i], g.master[i].detach()) if i < len(g.trainable)
                else g.sharded_params[i].detach() for g in self._paro_state.groups for i, ref in enumerate(g.refs)}

    @torch.no_grad()
    def push_masters(self) -> None:
        """Bring every parameter to its fp32 master's values, as after an optimizer step: call it
        after writing the masters in place (``master_state_dict`` loaded by DCP)."""
        groups = self._paro_state.groups
        self._paro_state.pushes.finish()
        for g in groups:
            g.reshard()  # a gathered copy would be stale
        drive([push_params(g) for g in groups if g.trainable])

    def paro_strategies(self) -> dict[str, Strategy]:
        return {ref.fqn: g.strategy for g in self._paro_state.groups for ref in g.refs}

    def paro_mesh_groups(self) -> MeshGroups:
        """The mesh's sizes and c10d group names (plain data): what the graph passes need to
        tell an intra collective from an inter or global one (``passes.install(meshes=...)``)."""
        return self._paro_state.info.groups


def in_flight_bytes(state: ParoState) -> int:
    """The most ``overlap`` and the reductions' slack keep alive at once (``memory_report``)."""
    def grad_buffer(g: ParoParamGroup) -> int:  # a G-level reduction's input, FULL or NESTED
        return g.t_layout.numel(Level.N) * g.mp.grad_dtype.itemsize if g.trainable and g.strategy.g != Level.N else 0

    slack = max((sum(grad_buffer(g) for g in b.groups) for b in state.blocks), default=0)
    boundary = min(state.boundary.limit_bytes, sum(boundary_bytes(g) for g in state.groups if g.trainable and state.info.n > 1))
    pushes = min(state.pushes.limit_bytes, sum(push_bytes(g) for g in state.groups if push_dims(g)))
    return max(slack + boundary, pushes)


def _as_p_level(group: ParoParamGroup, i: int, whole: torch.Tensor) -> DTensor:
    """A whole tensor as a DTensor like the sharded parameter (this rank's shard of it), so
    nn.Module's in-place copy into the DTensor parameter works."""
    param = group.sharded_params[i]
    local = group.p_layout.tensors[i].local_slice(whole.detach().to(group.device), group.strategy.p, group.info.k)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _blocks_of(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Blocks from ``blocks=``: containers (``nn.ModuleList``, ``nn.ModuleDict``, e.g.
    torchtitan's ``model.layers``) stand for their elements."""
    out: list[nn.Module] = []
    for m in modules:
        if isinstance(m, nn.ModuleList):
            out += _blocks_of(m)
        elif isinstance(m, nn.ModuleDict):
            out += _blocks_of(m.values())
        elif isinstance(m, nn.Module):
            out.append(m)
        else:
            raise TypeError(f"blocks= takes modules (or ModuleList / ModuleDict of them), got {type(m).__name__}")
    return out


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    """Each element of every outermost ``nn.ModuleList`` and each value of every outermost
    ``nn.ModuleDict``: a container inside a block (peft's ``lora_A`` / ``lora_B`` ModuleDicts, a
    layer's experts) stays part of that block, as FSDP2 users wrap whole layers (nested blocks
    would make every LoRA matrix a block, with a collective of its own)."""
    out: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # parents before children
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        for child in module.children():
            out.append(child)
            inside.update(id(m) for m in child.modules())
    return out


def paro_shard(model: nn.Module, mesh: DeviceMesh, policy: PolicyLike = "IIG", mp: Optional[MixedPrecision] = None,
               blocks: Optional[Iterable[nn.Module]] = None, reshard_after_forward: bool = True,
               param_init_fn: Optional[Callable[[str, torch.Tensor], None]] = None,
               flat_below_bytes: int = 0) -> nn.Module:
    """Shard ``model`` in place with a PaRO ``policy`` and return it.

    Parameters are bucketed per block (``_default_blocks``, or ``blocks``: modules, or containers
    standing for their elements; the root holds the rest) and per strategy inside a block. The
    model must hold the same initial values on every rank; built on the CPU, it moves to the
    mesh's device shard by shard. The root's parameters stay gathered from forward to backward (as
    FSDP2's root); blocks are freed after forward unless ``reshard_after_forward=False``.

    A model on the meta device is materialised one tensor at a time: ``param_init_fn(name,
    tensor)`` fills each whole fp32 tensor (identically on every rank), this rank keeps its
    shards, and no rank ever holds the whole model.

    ``flat_below_bytes``: global collectives on smaller messages run as one flat collective over
    all ranks instead of PaRO-CC's two phases (the ledger follows the same rule); 0 (default):
    always hierarchical. Where flat wins depends on the links: ``tools.bench.collectives``.
    """
    if hasattr(model, "_paro_state"):
        raise ValueError("model is already sharded by paro_shard")
    mp = mp or MixedPrecision()
    info = MeshInfo.from_mesh(mesh)
    if any(p.is_meta for p in model.parameters()) and param_init_fn is None:
        raise ValueError("the model has parameters on the meta device: pass param_init_fn=(name, tensor) -> None "
                         "to paro_shard so it can materialise them shard by shard")
    comm = MeshComm(info.groups, streams_for(mesh_device(info)))
    cc = ParoCC(comm, flat_below_bytes=flat_below_bytes)  # the model's one PaRO-CC: global collectives, counted in comm.stats

    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(p, []).append((module, attr))
    named = list(model.named_parameters())
    strategies = resolve_policy(policy, named)

    block_modules = _blocks_of(blocks) if blocks is not None else _default_blocks(model)
    if any(b is model for b in block_modules):
        raise ValueError("blocks= must not contain the model itself; the root is always a block")
    if len({id(b) for b in block_modules}) != len(block_modules):
        raise ValueError("blocks= names a module twice")
    block_of: dict[nn.Parameter, nn.Module] = {}
    for b in block_modules:  # later (inner) blocks override earlier (outer) ones
        for p in b.parameters():
            block_of[p] = b

    state = ParoState(info, comm, cc, [])
    for module, name in [(model, "<root>")] + [(b, _name_of(model, b)) for b in block_modules]:
        by_strategy: dict[Strategy, list[ParamRef]] = {}
        for fqn, p in named:
            if block_of.get(p, model) is module:
                by_strategy.setdefault(strategies[fqn], []).append(ParamRef.of(fqn, p, owners[p]))
        groups = [
            ParoParamGroup(f"{name}:{s}", s, refs, info, comm, cc, mp, reshard_after_forward, param_init_fn)
            for s, refs in by_strategy.items()
        ]
        make_sinks_on_compile(groups)
        block = ParoBlock(name, module, groups, state)
        if module is model:
            block.is_root = True
            block.module = _entry_module(model)  # where the root's hooks go
            block.cast_inputs = mp.input_dtype
        state.blocks.append(block)
    _move_buffers(model, mesh_device(info))
    state.install_hooks()
    model._paro_state = state
    cls = model.__class__
    model.__class__ = type(f"Paro{cls.__name__}", (ParoModule, cls), {})
    return model


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Module buffers (RoPE tables, norms' running stats) follow the parameters to the mesh's
    device, as FSDP2 moves them; meta buffers are left for the model's own init."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


def _entry_module(model: nn.Module) -> nn.Module:
    """The innermost module every call of the model passes through: the deepest one containing
    every module that owns a parameter. The root's hooks go there, so a wrapper that calls its
    inner model directly (``PeftModel.generate``) still meets a gathered model. It stays the model
    itself when a parameter lives outside every child (GPT-2's tied ``lm_head``)."""
    owners = {id(m) for m in model.modules() if any(p is not None for p in m._parameters.values())}
    entry = model
    while owners:
        for child in entry.children():
            # a container without a forward of its own (ModuleList, ModuleDict) is never called
            callable_ = type(child).forward is not nn.Module.forward
            if callable_ and owners <= {id(m) for m in child.modules()}:
                entry = child
                break
        else:
            return entry
    return entry


def _name_of(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    raise ValueError("every module in blocks= must be a submodule of the model")
