"""PaRO inside torchtitan 0.3's own ``Trainer``: one flag away from FSDP2 (docs/torchtitan.md).

    python -m torchtitan.train --module paro_fsdp.integrations.torchtitan \\
        --config llama3_8b_paro --paro.strategy IIG --paro.group_size 8

torchtitan keeps its model, data, loss, LR schedule, metrics, checkpointer and loop. What
changes: ``parallelize_paro`` (its AC and per-block compile, with the engine's hooks inside each
block's graph, then ``paro_shard`` on the blocks unwrapped from the AC wrapper, so recomputation
re-gathers; gradients summed, as its loss is already divided by the global token count);
parameters drawn inside ``paro_shard`` by its own per-parameter initialisers, seeded by name;
``ParoOptimizersContainer`` (clips at ``step()``, its ``clip_grad_norm_`` sees no ``.grad``; a
flat DTensor state dict that interchanges with FSDP2, plus each fp32 master so a bf16 resume
does not drift); ``ParoTrainer`` (marks the last micro-batch, computes the chunked loss
unchunked, reads checkpoints through ``safe_load``: torchtitan's ``dcp.load`` would unpickle a
crafted folder on every rank).

Not supported (a clear error at start-up): tensor, pipeline, context and expert parallelism,
HSDP replicate degrees (PaRO's group size replaces them), and regex optimizer param groups.
"""
from __future__ import annotations

import dataclasses
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from paro_fsdp import MixedPrecision, ParoOptimizer, init_paro_mesh, paro_shard
from paro_fsdp.checkpoint_files import SafeReader, safe_load

__all__ = ["ParoConfig", "ParoOptimizersContainer", "ParoTrainer", "parallelize_paro", "safe_dcp_load",
           "llama3_debug_paro", "llama3_8b_paro", "llama3_70b_paro", "to_paro"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True, slots=True)
class ParoConfig:
    """The ``[paro]`` section (CLI ``--paro.<key>``)."""

    enable: bool = True
    """False: torchtitan's own FSDP2 path, everything else alike (the one flag)."""
    strategy: str = "IIG"
    """Three letters P G OS from N / I / G (README "Strategies")."""
    group_size: int = 8
    """Ranks per group, usually the GPUs of one node; must divide the world size."""
    policy: dict[str, str] = field(default_factory=dict)
    """Per-tensor strategies: fnmatch pattern over parameter names -> strategy (first match
    wins, ``strategy`` for the rest)."""
    reshard_after_forward: bool = True
    """Free gathered blocks after forward (re-gather in backward)."""
    accumulate_dtype: str = "float32"
    """dtype of the gradient accumulator over micro-batches (float32 | bfloat16)."""
    seed: int = 0
    """Parameter init: each tensor's values depend only on (seed, name)."""


# ---- the model ------------------------------------------------------------------------------
class _TitanParoModel:
    """Mixed into the sharded model's class: torchtitan calls ``to_empty`` and ``init_weights``
    after its parallelize function. The parameters were materialised inside ``paro_shard``,
    and re-allocating or re-drawing them would detach them from the engine's storage (and
    leave the fp32 masters stale), so only buffers are allocated and initialised."""

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> nn.Module:
        for module in self.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.empty_like(buf, device=device)
        return self

    def init_weights(self, buffer_device: torch.device | None = None, **_: Any) -> None:
        from torchtitan.protocols.module import Module

        for module in self.modules():
            if isinstance(module, Module):
                module._init_self_buffers(buffer_device=buffer_device)


def _param_init_fn(model: nn.Module, seed: int) -> Callable[[str, torch.Tensor], None]:
    """``paro_shard``'s ``param_init_fn`` from torchtitan's per-parameter initialisers: the
    owning module's ``param_init`` entry (or its ``reset_parameters`` on a stand-in holding
    only this tensor), under a generator seeded from (seed, canonical name)."""
    modules = dict(model.named_modules())

    def init(fqn: str, tensor: torch.Tensor) -> None:
        owner_name, _, attr = fqn.rpartition(".")
        owner = modules[owner_name]
        devices = [tensor.device] if tensor.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(canonical_fqn(fqn).encode()))
            table = getattr(owner, "_param_init", None)
            if table is not None:
                table[attr](tensor)
            elif callable(getattr(owner, "reset_parameters", None)):
                stand_in = nn.Module.__new__(type(owner))
                stand_in.__dict__ = dict(owner.__dict__)
                stand_in._parameters = {k: (nn.Parameter(tensor, requires_grad=False) if k == attr else
                                            nn.Parameter(torch.empty_like(v, device="meta"), requires_grad=False))
                                        for k, v in owner._parameters.items()}
                stand_in.reset_parameters()
            else:
                raise ValueError(f"no initialiser for {fqn}: {type(owner).__name__} has neither param_init "
                                 f"nor reset_parameters")

    return init


def _unwrap(block: nn.Module) -> nn.Module:
    """The module inside torchtitan's activation-checkpoint wrapper: the engine's hooks go on
    it, so they run (again) inside the recomputation."""
    return getattr(block, "_checkpoint_wrapped_module", block)


@contextmanager
def _compile_with_hooks(blocks: list[nn.Module]) -> Iterator[None]:
    """While torchtitan's ``apply_compile`` runs, a block not wrapped for activation checkpointing
    compiles through ``traced.compile_block`` (with torchtitan's backend and ``fullgraph``).
    Why: ``block.compile()`` compiles ``_call_impl``, a frame dynamo skips, so the engine's hooks
    on that block (``paro_shard`` registers them later) became a graph of their own, whose
    outputs, the gathered whole tensors, the block's graph saved for backward
    (``reshard_after_forward`` lost, no re-gather in backward). A wrapped block is left as it
    is: its hooks are on the module inside, which dynamo inlines from the wrapper's forward."""
    from paro_fsdp.traced import compile_block

    redirected = [b for b in blocks if _unwrap(b) is b]
    for block in redirected:  # an instance attribute: torchtitan calls transformer_block.compile(...)
        block.compile = partial(compile_block, block)
    try:
        yield
    finally:
        for block in redirected:
            block.__dict__.pop("compile", None)


def parallelize_paro(model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any,
                     compile_config: Any, ac_config: Any, dump_folder: str, paro: ParoConfig) -> nn.Module:
    """torchtitan's ``parallelize_fn`` contract (``ModelSpec.parallelize_fn``) with PaRO in
    place of FSDP2: activation checkpointing, per-block compile, then ``paro_shard``."""
    from torchtitan.distributed.compile import apply_compile

    check_supported(parallelism)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        with _compile_with_hooks(list(model.get_submodule("layers").values())):
            apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    mesh = init_paro_mesh(paro.group_size)
    mp = MixedPrecision(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                        accumulate_dtype=DTYPES[paro.accumulate_dtype])
    policy: Any = paro.strategy
    if paro.policy:
        policy = {**paro.policy, "default": paro.strategy}
    blocks = [_unwrap(b) for b in model.get_submodule("layers").values()]
    model = paro_shard(model, mesh, policy, mp=mp, blocks=blocks, reshard_after_forward=paro.reshard_after_forward,
                       param_init_fn=_param_init_fn(model, paro.seed))
    model.set_gradient_divide_factor(1.0)  # torchtitan's loss is already divided by the global token count
    logger.info(startup_line(model, paro, mp, len(blocks)))
    cls = model.__class__
    model.__class__ = type(cls.__name__, (_TitanParoModel, cls), {})
    return model


def startup_line(model: nn.Module, paro: ParoConfig, mp: MixedPrecision, n_blocks: int) -> str:
    """What the log says once the model is sharded, as FSDP2's "Applied FSDP to the model"."""
    info = model._paro_state.info
    strategies = sorted({str(s) for s in model.paro_strategies().values()})
    policy = f" (per-tensor policy {dict(paro.policy)}, default {paro.strategy})" if paro.policy else ""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return (f"PaRO {'/'.join(strategies)}{policy}, groups of {info.m} ({info.g} groups, {info.n} ranks): "
            f"{n_blocks} blocks + root, P {short[mp.param_dtype]}, gradients {short[mp.grad_dtype]} (summed in "
            f"{short[mp.acc_dtype]}), fp32 masters and optimizer state at the OS level, reshard_after_forward "
            f"{paro.reshard_after_forward} (FSDP2 instead: --paro.no-enable)")


def check_supported(parallelism: Any) -> None:
    """PaRO is the data parallelism; nothing else is combined with it yet."""
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "expert_parallel_degree", "data_parallel_replicate_degree"):
        if getattr(parallelism, key, 1) not in (1, -1):
            hint = " (PaRO's groups replace HSDP: set --paro.group_size)" if "replicate" in key else ""
            raise ValueError(f"parallelism.{key} = {getattr(parallelism, key)}: not supported with PaRO{hint}; "
                             f"set it to 1 or run FSDP2 with --paro.enable false")


def check_param_groups(groups: list[Any]) -> None:
    """One catch-all optimizer group: the masters are flat per block and strategy."""
    if len(groups) != 1 or groups[0].pattern not in (".*", "", "^.*$"):
        raise ValueError(
            f"optimizer.param_groups: {len(groups)} group(s) ({[g.pattern for g in groups]}); PaRO takes one "
            f"catch-all group (pattern '.*'). Regex param groups are not supported with PaRO: put per-tensor "
            f"strategies in paro.policy, or run FSDP2 with --paro.enable false")


# ---- the optimizer --------------------------------------------------------------------------
class ParoOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizers container around one ``ParoOptimizer``. ``optimizers`` holds
    the inner torch optimizer (over the fp32 master shards), which torchtitan's LR schedulers
    wrap; ``step()`` finishes the gradient reduction, clips by the global norm (kept in
    ``grad_norm`` for the log) and updates. A model that is not PaRO-sharded (``paro.enable =
    false``) gets torchtitan's own container unchanged."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        max_norm: float = 1.0
        """Clipping norm; ``ParoTrainer`` copies ``training.max_norm`` here."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self.paro: ParoOptimizer | None = None
        self.grad_norm = torch.zeros(())
        if not any(hasattr(m, "_paro_state") for m in model_parts):
            OptimizersContainer.__init__(self, config, model_parts=model_parts)
            return
        if len(model_parts) != 1:
            raise ValueError("PaRO runs one model part (no pipeline parallelism)")
        check_param_groups(config.param_groups)
        group = config.param_groups[0]
        factory = self._resolve_optimizer_factory(group.optimizer_name)
        if factory not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(f"optimizer {group.optimizer_name!r} is not supported with PaRO (Adam, AdamW)")
        kwargs = {**self._build_impl_kwargs(config), **group.optimizer_kwargs}
        self.model_parts = model_parts
        self.max_norm = float(config.max_norm)
        self.paro = ParoOptimizer(model_parts[0], factory, **kwargs)
        self.optimizers = [self.paro.inner]
        Optimizer.__init__(self, list(self.paro.fqn_of), {})

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if self.paro is None:
            return OptimizersContainer.step(self, closure)
        assert closure is None, "OptimizersContainer does not support closures"
        self.grad_norm = self.paro.clip_grad_norm_(self.max_norm)
        self.paro.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.paro is None:
            return OptimizersContainer.zero_grad(self, set_to_none)
        self.paro.zero_grad(set_to_none)

    def _names(self) -> list[tuple[str, torch.Tensor]]:
        return [(canonical_fqn(self.paro.fqn_of[m]), m) for pg in self.paro.inner.param_groups for m in pg["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat format (``state.{fqn}.{name}``, ``param_groups.{fqn}.{key}``), the
        per-parameter states as DTensors at the OS level, so DCP reshards them to any mesh and
        any strategy, FSDP2's included."""
        if self.paro is None:
            return OptimizersContainer.state_dict(self)
        p = self.paro
        p._ensure_state()
        layout_of = {id(m): (g, t) for g in p.groups for t, m in zip(g.t_layout.tensors, g.master)}
        flat: dict[str, Any] = {}
        for fqn, m in self._names():
            g, t = layout_of[id(m)]
            for key, value in p.inner.state[m].items():
                if torch.is_tensor(value) and value.dim() and value.shape == m.shape:
                    value = g.os_dtensor(t, value)
                flat[f"state.{fqn}.{key}"] = value
            flat[f"state.{fqn}.{MASTER}"] = g.os_dtensor(t, m.detach())  # a view: DCP loads the master in place
        for pg in p.inner.param_groups:
            for m in pg["params"]:
                fqn = canonical_fqn(p.fqn_of[m])
                for key, value in pg.items():
                    if key not in ("params", "param_names"):
                        flat[f"param_groups.{fqn}.{key}"] = value
        return flat

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.paro is None:
            return OptimizersContainer.load_state_dict(self, state_dict)
        p = self.paro
        p._ensure_state()
        for fqn, m in self._names():
            state = p.inner.state[m]
            for key, old in [(MASTER, m)] + [(k, state[k]) for k in list(state)]:
                value = state_dict.get(f"state.{fqn}.{key}")
                value = value.to_local() if isinstance(value, DTensor) else value
                if value is None or (torch.is_tensor(old) and old.data_ptr() == value.data_ptr()):
                    continue  # not saved, or DCP loaded it in place
                if torch.is_tensor(old):
                    old.copy_(value)
                else:
                    state[key] = value
        for pg in p.inner.param_groups:
            fqn = canonical_fqn(p.fqn_of[pg["params"][0]])
            for key in list(pg):
                if key not in ("params", "param_names") and f"param_groups.{fqn}.{key}" in state_dict:
                    pg[key] = state_dict[f"param_groups.{fqn}.{key}"]


MASTER = "master_fp32"  # the container's key for a parameter's fp32 master (``state.{fqn}.master_fp32``)


class _SavedKeysOnly:
    """The optimizers container as DCP's Stateful, asking only for the fp32 masters the
    checkpoint holds: one FSDP2 wrote has none (the masters then come from the model's weights,
    ``ParoModule.load_state_dict``), and DCP refuses a key the checkpoint lacks."""

    def __init__(self, inner: Any, saved: set[str], prefix: str) -> None:
        self.inner, self.saved, self.prefix = inner, saved, prefix

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.inner.state_dict().items()
                if not k.endswith(f".{MASTER}") or f"{self.prefix}.{k}" in self.saved}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


# ---- the trainer ----------------------------------------------------------------------------
def safe_dcp_load(checkpointer: Any, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                  from_quantized: bool) -> None:
    """torchtitan 0.3's ``CheckpointManager.dcp_load``, step for step, with ``safe_load`` in place
    of ``dcp.load``: DCP folders through the safe reader and planner, Hugging Face safetensors
    through torch's ``HuggingFaceStorageReader`` (tensors and a JSON header) with the safe planner."""
    from torchtitan.components.checkpointer.base import MODEL

    if from_hf:
        adapter = checkpointer.sd_adapter
        if adapter is None:
            raise ValueError("loading a checkpoint in HF safetensors format needs the model's state dict adapter")
        hf_state_dict = adapter.to_hf(state_dict)
        safe_load(hf_state_dict, storage_reader=adapter.get_hf_storage_reader(checkpoint_id, from_quantized))
        checkpointer.states[MODEL].load_state_dict(adapter.from_hf(hf_state_dict))
    else:
        from torchtitan.components.checkpointer.base import OPTIMIZER

        container = state_dict.get(OPTIMIZER)
        if isinstance(container, ParoOptimizersContainer) and container.paro is not None:
            saved = set(SafeReader(checkpoint_id).read_metadata().state_dict_metadata)
            state_dict = {**state_dict, OPTIMIZER: _SavedKeysOnly(container, saved, OPTIMIZER)}
        safe_load(state_dict, checkpoint_id)
        if MODEL in checkpointer.states:  # torchtitan flattens the model's states into state_dict
            checkpointer.states[MODEL].load_state_dict(state_dict)


class ParoTrainer(Trainer):
    """torchtitan's ``Trainer`` with a ``paro`` config section. With ``paro.enable`` it swaps
    in ``parallelize_paro`` and ``ParoOptimizersContainer``, marks the last micro-batch of each
    step, and logs the norm the container clipped by; without, it is torchtitan's trainer.
    Either way its checkpoints are read with ``safe_dcp_load`` (no code runs from a folder)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        paro: ParoConfig = field(default_factory=ParoConfig)

        def __post_init__(self) -> None:
            if self.paro.enable:  # first: torchtitan's own checks would name other keys (CUDA graphs with PP)
                check_supported(self.parallelism)
                check_param_groups(self.optimizer.param_groups)
            Trainer.Config.__post_init__(self)

    def __init__(self, config: Config) -> None:
        self._micro = 0
        if config.paro.enable:
            spec = config.model_spec
            config.model_spec = dataclasses.replace(spec, parallelize_fn=partial(parallelize_paro, paro=config.paro),
                                                    pipelining_fn=None)
            opt = config.optimizer
            if not isinstance(opt, ParoOptimizersContainer.Config):
                opt = ParoOptimizersContainer.Config(**{f.name: getattr(opt, f.name) for f in dataclasses.fields(opt)})
            opt.max_norm = float(config.training.max_norm)
            config.optimizer = opt
            from torchtitan.components.loss import ChunkedLossWrapper

            if isinstance(config.loss, ChunkedLossWrapper.Config):
                # the chunked loss calls lm_head outside the model's forward, where PaRO has
                # not gathered its weight: compute the same loss unchunked
                config.loss = config.loss.loss_fn
        super().__init__(config)
        self._read_checkpoints_safely()
        if config.paro.enable:
            self.titan_log = self.metrics_processor.log

            def log_paro_norm(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
                # torchtitan's own clip saw no .grad (the masters hold the gradients): log ours
                return self.titan_log(step, global_avg_loss, global_max_loss, float(self.optimizers.grad_norm),
                                      extra_metrics=extra_metrics)

            self.metrics_processor.log = log_paro_norm

    def _read_checkpoints_safely(self) -> None:
        """Route the checkpointer's loads (resume, ``initial_load_path``, HF) through
        ``safe_dcp_load``; it is set up in ``Trainer.__init__`` and loads only in ``train()``."""
        if callable(getattr(self.checkpointer, "dcp_load", None)):  # the DCP checkpointer (the only one that loads in 0.3)
            self.checkpointer.dcp_load = partial(safe_dcp_load, self.checkpointer)

    def train_step(self, data_iterator: Any) -> None:
        self._micro = 0
        return super().train_step(data_iterator)

    def forward_backward_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.config.paro.enable:
            self._micro += 1
            for m in self.model_parts:
                m.set_is_last_backward(self._micro == self.gradient_accumulation_steps)
        return super().forward_backward_step(*args, **kwargs)


# ---- config functions (``--module paro_fsdp.integrations.torchtitan --config <name>``) ------
def to_paro(config: Trainer.Config, **paro: Any) -> ParoTrainer.Config:
    """Any torchtitan ``Trainer.Config`` as a ``ParoTrainer.Config`` with a ``paro`` section."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return ParoTrainer.Config(**values, paro=ParoConfig(**paro))


def _llama3(name: str) -> ParoTrainer.Config:
    from torchtitan.models.llama3 import config_registry

    return to_paro(getattr(config_registry, name)())


def llama3_debug_paro() -> ParoTrainer.Config:
    """torchtitan's debug Llama 3 (``llama3_debugmodel``) with PaRO IIG in groups of 8."""
    return _llama3("llama3_debugmodel")


def llama3_8b_paro() -> ParoTrainer.Config:
    """Llama 3 8B (``llama3_8b``) with PaRO IIG, groups of 8 GPUs (one node)."""
    return _llama3("llama3_8b")


def llama3_70b_paro() -> ParoTrainer.Config:
    """Llama 3 70B (``llama3_70b``) with PaRO IIG, groups of 8 GPUs (one node)."""
    return _llama3("llama3_70b")
