"""PaRO inside torchtitan 0.3's own ``Trainer``: one flag away from FSDP2 (docs/torchtitan.md).

    python -m torchtitan.train --module paro_fsdp.integrations.torchtitan \\
        --config llama3_8b_paro --paro.strategy IIG --paro.group_size 8

torchtitan keeps its model, data, loss, LR schedule, metrics, checkpointer and loop, and, as the
sharded model keeps FSDP2's contract (docs/fsdp2.md), its own optimizers container (param groups
by regex included) over ``model.parameters()`` (the fp32 masters, DTensors at each tensor's OS
level), its own ``clip_grad_norm_`` over their ``.grad`` and its own checkpoint states (the model's
state dict holds the fp32 masters, the optimizer's is FQN-keyed DTensors: checkpoints interchange
with FSDP2's, a bf16 resume included). What changes: ``parallelize_paro`` (its AC and per-block
compile, with the engine's hooks inside each block's graph, then ``paro_shard`` on the blocks
unwrapped from the AC wrapper, so recomputation re-gathers; gradients summed, as its loss is
already divided by the global token count); parameters drawn inside ``paro_shard`` by its own
per-parameter initialisers, seeded by name; ``ParoTrainer`` (reduces the gradients on the last
micro-batch only, ``set_requires_gradient_sync``; computes the chunked loss unchunked; reads
checkpoints through ``safe_load``: torchtitan's ``dcp.load`` would unpickle a crafted folder on
every rank).

Not supported (a clear error at start-up): tensor, pipeline, context and expert parallelism, and
HSDP replicate degrees (PaRO's group size replaces them).
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

from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
from paro_fsdp.checkpoint_files import safe_load

__all__ = ["ParoConfig", "ParoTrainer", "parallelize_paro", "safe_dcp_load",
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
    """Mixed into the sharded model's class (which keeps its name): torchtitan calls
    ``to_empty`` and ``init_weights`` after its parallelize function. The parameters (the fp32
    masters) were materialised inside ``paro_shard``, and re-allocating them would detach them
    from the engine's storage, so only buffers are allocated and initialised."""

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
    model.__class__ = type(cls.__name__, (_TitanParoModel, cls),
                           {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return model


def startup_line(model: nn.Module, paro: ParoConfig, mp: MixedPrecision, n_blocks: int) -> str:
    """What the log says once the model is sharded, as FSDP2's "Applied FSDP to the model"."""
    info = model._paro_state.info
    strategies = sorted({str(s) for s in model.paro_strategies().values()})
    policy = f" (per-tensor policy {dict(paro.policy)}, default {paro.strategy})" if paro.policy else ""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return (f"PaRO {'/'.join(strategies)}{policy}, groups of {info.m} ({info.g} groups, {info.n} ranks): "
            f"{n_blocks} blocks + root, P {short[mp.param_dtype]}, gradients {short[mp.grad_dtype]} (summed in "
            f"{short[mp.acc_dtype]}), parameters = fp32 masters and optimizer state at the OS level, reshard_after_forward "
            f"{paro.reshard_after_forward} (FSDP2 instead: --paro.no-enable)")


def check_supported(parallelism: Any) -> None:
    """PaRO is the data parallelism; nothing else is combined with it yet."""
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "expert_parallel_degree", "data_parallel_replicate_degree"):
        if getattr(parallelism, key, 1) not in (1, -1):
            hint = " (PaRO's groups replace HSDP: set --paro.group_size)" if "replicate" in key else ""
            raise ValueError(f"parallelism.{key} = {getattr(parallelism, key)}: not supported with PaRO{hint}; "
                             f"set it to 1 or run FSDP2 with --paro.enable false")


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
        safe_load(state_dict, checkpoint_id)
        if MODEL in checkpointer.states:  # torchtitan flattens the model's states into state_dict
            checkpointer.states[MODEL].load_state_dict(state_dict)


class ParoTrainer(Trainer):
    """torchtitan's ``Trainer`` with a ``paro`` config section. With ``paro.enable`` it swaps
    in ``parallelize_paro`` and reduces the gradients on the last micro-batch of each step only
    (``set_requires_gradient_sync``: the others keep them at the G level); the optimizers
    container, clipping, LR schedule and checkpoint states are torchtitan's own. Without, it is
    torchtitan's trainer. Either way its checkpoints are read with ``safe_dcp_load`` (no code
    runs from a folder)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        paro: ParoConfig = field(default_factory=ParoConfig)

        def __post_init__(self) -> None:
            if self.paro.enable:  # first: torchtitan's own checks would name other keys (CUDA graphs with PP)
                check_supported(self.parallelism)
            Trainer.Config.__post_init__(self)

    def __init__(self, config: Config) -> None:
        self._micro = 0
        if config.paro.enable:
            spec = config.model_spec
            config.model_spec = dataclasses.replace(spec, parallelize_fn=partial(parallelize_paro, paro=config.paro),
                                                    pipelining_fn=None)
            from torchtitan.components.loss import ChunkedLossWrapper

            if isinstance(config.loss, ChunkedLossWrapper.Config):
                # the chunked loss calls lm_head outside the model's forward, where PaRO has
                # not gathered its weight: compute the same loss unchunked
                config.loss = config.loss.loss_fn
        super().__init__(config)
        self._read_checkpoints_safely()

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
            # FSDP2 reduces every micro-batch; PaRO keeps the gradients at the G level until the
            # last one, whose backward reduces them into the parameters' .grad for torchtitan's
            # clip_grad_norm_ and optimizers
            self._micro += 1
            for m in self.model_parts:
                m.set_requires_gradient_sync(self._micro == self.gradient_accumulation_steps)
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
