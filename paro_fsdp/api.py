"""``paro_shard``: the whole-model form (per-tensor policies, blocks found), and the builder
``fully_shard`` shares: bucket the parameters per block and strategy, build the groups, install
the hooks."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .comm import MeshComm
from .mesh import MeshInfo, mesh_device
from .mixed_precision import MixedPrecision
from .module import mix_in, track_state_dict_writes
from .paro_cc import ParoCC
from .param import ParamRef
from .param_group import ParoParamGroup
from .state import ParoBlock, ParoState, unwatch, watch
from .strategy import PolicyLike, Strategy, resolve_policy
from .streams import streams_for
from .traced import make_sinks_on_compile


def _blocks_of(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Blocks from ``blocks=``: a ``ModuleList`` / ``ModuleDict`` (``model.layers``) stands for its elements."""
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
    """The elements of every outermost ``ModuleList`` / ``ModuleDict``: a container inside a block (peft's
    ``lora_A`` / ``lora_B``, a layer's experts) stays in it, as FSDP2 users wrap whole layers (else every LoRA
    matrix would be a block with a collective of its own)."""
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
               flat_below_bytes: int = 0, memory_budget: Optional[float] = None, workload: Any = None,
               cluster: Any = None) -> nn.Module:
    """Shard ``model`` in place with a PaRO ``policy`` and return it (docs/api.md).

    Parameters are bucketed per block (``_default_blocks``, or ``blocks``; the root holds the rest) and
    per strategy. The model must hold the same initial values on every rank; on the meta device each
    tensor is materialised by ``param_init_fn(name, tensor)``, so no rank holds the whole model.
    ``flat_below_bytes``: smaller global collectives run flat, not through PaRO-CC (0: never).
    ``policy="auto"``: a strategy per block within ``memory_budget`` bytes per rank, for ``workload`` on
    ``cluster`` (None: calibrate the mesh now, collective); docs/advisor.md.
    """
    if hasattr(model, "_paro_state"):
        raise ValueError("model is already sharded by paro_shard")
    block_modules = _blocks_of(blocks) if blocks is not None else _default_blocks(model)
    policy = _auto(model, mesh, policy, block_modules, mp or MixedPrecision(), memory_budget, workload, cluster,
                   reshard_after_forward, flat_below_bytes, "paro_shard(model, mesh, \"auto\", memory_budget=...)")
    strategies = resolve_policy(policy, list(model.named_parameters()))
    return build(model, mesh, strategies, block_modules, mp or MixedPrecision(), {}, reshard_after_forward,
                 param_init_fn, flat_below_bytes)


def is_auto(policy: Any) -> bool:
    return isinstance(policy, str) and policy.strip().lower() == "auto"


def _auto(model: nn.Module, mesh: DeviceMesh, policy: Any, block_modules: list[nn.Module], mp: MixedPrecision,
          memory_budget: Optional[float], workload: Any, cluster: Any, reshard_after_forward: bool,
          flat_below_bytes: int, how: str) -> Any:
    """``"auto"``: the budgeted plan as a per-tensor policy; another policy as it is, refusing "auto"'s options."""
    if not is_auto(policy):
        if memory_budget is not None or workload is not None or cluster is not None:
            raise ValueError(f"memory_budget=, workload= and cluster= are read only by strategy \"auto\" (got "
                             f"{policy!r}); use {how}, or drop them")
        return policy
    from .cost.budget import auto_policy

    return auto_policy(model, mesh, block_modules, memory_budget, mp, workload, cluster, reshard_after_forward,
                       flat_below_bytes)


def build(model: nn.Module, mesh: DeviceMesh, strategies: dict[str, Strategy], block_modules: list[nn.Module],
          mp: MixedPrecision, block_settings: dict[int, tuple[MixedPrecision, bool]],
          reshard_after_forward: Optional[bool], param_init_fn: Optional[Callable[[str, torch.Tensor], None]] = None,
          flat_below_bytes: int = 0, adopted: list[ParoState] = (),
          root_hooks_on: Optional[list[nn.Module]] = None) -> nn.Module:
    """The engine over ``model``: a ``ParoBlock`` per block module and the root, a group per block and
    strategy. ``block_settings``: by ``id``, a block's own (mixed precision, ``reshard_after_forward``).
    ``adopted``: engines of modules inside ``model`` sharded before it (see ``_adopt``).
    ``root_hooks_on``: the modules that carry the root's hooks and become its ``ParoModule`` s (default:
    ``_entry_module(model)``, and the model). ``reshard_after_forward`` None: FSDP2's default."""
    info = MeshInfo.from_mesh(mesh)
    taken = {id(p) for st in adopted for g in st.groups for p in g.sharded_params}
    named = [(fqn, p) for fqn, p in model.named_parameters() if id(p) not in taken]
    if any(p.is_meta for _, p in named) and param_init_fn is None:
        raise ValueError("the model has parameters on the meta device: pass param_init_fn=(name, tensor) -> None "
                         "to paro_shard so it can materialise them shard by shard")
    for _, p in named:  # the original tensors: a module outside this call that still holds one shares it
        p._paro_sharded = True
    comm = MeshComm(info.groups, streams_for(mesh_device(info)))
    cc = ParoCC(comm, flat_below_bytes=flat_below_bytes)  # the model's one PaRO-CC, counted in comm.stats

    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None and id(p) not in taken:
                owners.setdefault(p, []).append((module, attr))

    if any(b is model for b in block_modules):
        raise ValueError("blocks= must not contain the model itself; the root is always a block")
    if len({id(b) for b in block_modules}) != len(block_modules):
        raise ValueError("blocks= names a module twice")
    names = {id(m): n for n, m in model.named_modules()}
    if any(id(b) not in names for b in block_modules):
        raise ValueError("every module in blocks= must be a submodule of the model")
    block_of: dict[nn.Parameter, nn.Module] = {}
    for b in block_modules:  # later (inner) blocks override earlier (outer) ones
        for p in b.parameters():
            block_of[p] = b

    state = ParoState(info, comm, cc, [])
    for module, name in [(model, "<root>")] + [(b, names[id(b)]) for b in block_modules]:
        block_mp, raf = block_settings.get(id(module), (mp, reshard_after_forward))
        group_raf = raf is not False
        by_strategy: dict[Strategy, list[ParamRef]] = {}
        for fqn, p in named:
            if block_of.get(p, model) is module:
                by_strategy.setdefault(strategies[fqn], []).append(ParamRef.of(fqn, p, owners[p]))
        groups = [
            ParoParamGroup(f"{name}:{s}", s, refs, info, comm, cc, block_mp, group_raf, param_init_fn)
            for s, refs in by_strategy.items()
        ]
        make_sinks_on_compile(groups)
        block = ParoBlock(name, [module], groups, state, raf)
        block.cast_output = block_mp.output_dtype
        if module is model:
            block.is_root = True
            block.modules = list(root_hooks_on) if root_hooks_on is not None else [_entry_module(model)]
            block.cast_inputs = mp.input_dtype
        state.blocks.append(block)
    new_blocks = list(state.blocks)
    _adopt(model, state, adopted, names)
    _move_buffers(model, mesh_device(info))
    state.install_hooks(new_blocks)
    track_state_dict_writes(g for b in new_blocks for g in b.groups)
    for block in state.blocks:
        owners = (root_hooks_on or [model]) if block.is_root else block.modules
        for owner in owners:
            owner._paro_state, owner._paro_block = state, block
            mix_in(owner)
    watch(state)
    return model


def _adopt(model: nn.Module, state: ParoState, adopted: list[ParoState], names: dict[int, str]) -> None:
    """Blocks of engines built inside ``model`` join ``state`` after its own, in build order (the forward
    order ``fully_shard``'s calling pattern gives); their roots become blocks; names are read again."""
    for inner in adopted:
        if inner.info.mesh != state.info.mesh:  # equal meshes: each call's mesh=None builds its own, as torch's
            raise ValueError("fully_shard: every call on one model must use the same mesh (the blocks' and the root's)")
        inner.pushes.finish()
        for block in inner.blocks:
            if block.is_root:
                block.modules = [m for m in model.modules() if getattr(m, "_paro_block", None) is block]
                block.is_root = False  # its cast_inputs stay: FSDP2 casts at each sharded module's forward
            block.model_state = state
            block.name = ",".join(names[id(m)] for m in block.modules)
            for g in block.groups:
                g.comm, g.cc, g.info = state.comm, state.cc, state.info
                g.name = f"{block.name}:{g.strategy}"
                for ref in g.refs:
                    module, attr = ref.owners[0]
                    ref.fqn = f"{names[id(module)]}.{attr}" if names[id(module)] else attr
            state.blocks.append(block)
        unwatch(inner)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers follow the parameters to the mesh's device, as FSDP2's; meta ones are left to the model's init."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


def _entry_module(model: nn.Module) -> nn.Module:
    """The deepest module containing every parameter owner: the root's hooks go there, so a wrapper calling
    its inner model directly (``PeftModel.generate``) still meets a gathered model (GPT-2's tied ``lm_head``,
    outside every child, keeps the model itself)."""
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
