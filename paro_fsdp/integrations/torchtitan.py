"""PaRO inside torchtitan 0.3's own ``Trainer``: one flag away from FSDP2 (docs/torchtitan.md).

    python -m torchtitan.train --module paro_fsdp.integrations.torchtitan \\
        --config llama3_8b_paro --paro.strategy IIG --paro.group_size 8

Why so little: the sharded model keeps FSDP2's contract (docs/fsdp2.md), so torchtitan's model, data,
loss, optimizers, clipping, LR schedule, checkpoint states and loop stay its own. What changes:
``parallelize_paro``, and ``ParoTrainer`` (gradients reduced on the last micro-batch only, the chunked
loss unchunked, checkpoints read through ``safe_load``: ``dcp.load`` would unpickle a crafted folder).
Other parallelisms and HSDP replicate degrees stop at start-up (PaRO's group size replaces HSDP).
"""
from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
import torch.nn as nn

from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from paro_fsdp import MixedPrecision, ParoModule, init_paro_mesh, paro_shard
from paro_fsdp.checkpoint_files import safe_load
from paro_fsdp.dtypes import short_name

__all__ = ["ParoConfig", "ParoTrainer", "parallelize_paro", "safe_dcp_load",
           "llama3_debug_paro", "llama3_8b_paro", "llama3_70b_paro", "to_paro"]


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
    inter_dtype: str = "none"
    """What crosses between groups, quantized: int8 | int4 (gradients; parameters int8) | none (exact)."""
    seed: int = 0
    """Parameter init: each tensor's values depend only on (seed, name)."""


class _TitanParoModel:
    """Mixed into the sharded model's class: torchtitan's ``to_empty`` / ``init_weights`` after parallelizing
    would detach the parameters ``paro_shard`` materialised from the engine's storage: only buffers are made."""

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
    """torchtitan's own initialisers (``param_init``, or ``reset_parameters`` on a stand-in holding only this
    tensor), seeded by (seed, canonical name) so every rank draws the same values in any order."""
    modules = dict(model.named_modules())

    def init(fqn: str, tensor: torch.Tensor) -> None:
        owner_name, _, attr = fqn.rpartition(".")
        owner = modules[owner_name]
        devices = [tensor.device] if tensor.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(canonical_fqn(fqn).encode()))
            if getattr(owner, "_param_init", None) is not None:
                owner._init_param(attr, tensor)
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
    """The module inside an AC wrapper: the engine's hooks go on it, so they run inside the recomputation."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def parallelize_paro(model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any,
                     compile_config: Any, ac_config: Any, dump_folder: str, paro: ParoConfig) -> nn.Module:
    """torchtitan's ``ModelSpec.parallelize_fn`` with PaRO in place of FSDP2: AC, ``paro_shard``, then the
    per-block compile. Why compile last: a sharded block's ``compile()`` (``ParoModule.compile``) puts the
    hooks in its graph, so backward re-gathers instead of keeping the gathered tensors; an AC-wrapped block
    compiles as torch's, and dynamo inlines the hooks of the module inside from the wrapper's forward."""
    from torchtitan.distributed.compile import apply_compile

    check_supported(parallelism)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    mesh = init_paro_mesh(paro.group_size)
    mp = MixedPrecision(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                        accumulate_dtype=TORCH_DTYPE_MAP[paro.accumulate_dtype],
                        inter_dtype=None if paro.inter_dtype == "none" else paro.inter_dtype)
    policy = {**paro.policy, "default": paro.strategy} if paro.policy else paro.strategy
    blocks = [_unwrap(b) for b in model.get_submodule("layers").values()]
    model = paro_shard(model, mesh, policy, mp=mp, blocks=blocks, reshard_after_forward=paro.reshard_after_forward,
                       param_init_fn=_param_init_fn(model, paro.seed))
    for module in model.modules():  # torchtitan's loss is already divided by the global token count
        if isinstance(module, ParoModule):
            module.set_gradient_divide_factor(1.0)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
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
    return (f"PaRO {'/'.join(strategies)}{policy}, groups of {info.m} ({info.g} groups, {info.n} ranks): "
            f"{n_blocks} blocks + root, P {short_name(mp.param_dtype)}, gradients {short_name(mp.grad_dtype)} "
            f"(summed in {short_name(mp.acc_dtype)}), parameters = fp32 masters and optimizer state at the OS level, "
            f"reshard_after_forward {paro.reshard_after_forward} (FSDP2 instead: --paro.no-enable)")


def check_supported(parallelism: Any) -> None:
    """PaRO is the data parallelism; nothing else is combined with it yet."""
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "expert_parallel_degree", "data_parallel_replicate_degree"):
        if getattr(parallelism, key, 1) not in (1, -1):
            hint = " (PaRO's groups replace HSDP: set --paro.group_size)" if "replicate" in key else ""
            raise ValueError(f"parallelism.{key} = {getattr(parallelism, key)}: not supported with PaRO{hint}; "
                             f"set it to 1 or run FSDP2 with --paro.enable false")


def safe_dcp_load(checkpointer: Any, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                  from_quantized: bool) -> None:
    """torchtitan 0.3's ``CheckpointManager.dcp_load``, step for step, with ``safe_load`` in place of
    ``dcp.load`` (HF safetensors through ``HuggingFaceStorageReader`` with the safe planner)."""
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
    """torchtitan's ``Trainer`` with a ``paro`` section; ``paro.enable = False`` is torchtitan's
    trainer, its checkpoints still read with ``safe_dcp_load``."""

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
                # it calls lm_head outside the model's forward, where its weight is not gathered
                config.loss = config.loss.loss_fn
        super().__init__(config)
        self._read_checkpoints_safely()

    def _read_checkpoints_safely(self) -> None:
        """The checkpointer's loads (resume, ``initial_load_path``, HF) through ``safe_dcp_load``."""
        if callable(getattr(self.checkpointer, "dcp_load", None)):  # the DCP checkpointer, the only one that loads
            self.checkpointer.dcp_load = partial(safe_dcp_load, self.checkpointer)

    def train_step(self, data_iterator: Any) -> None:
        self._micro = 0
        return super().train_step(data_iterator)

    def forward_backward_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.config.paro.enable:
            # gradients stay at the G level until the last micro-batch reduces them into the .grad
            self._micro += 1
            for m in self.model_parts:
                m.set_requires_gradient_sync(self._micro == self.gradient_accumulation_steps)
        return super().forward_backward_step(*args, **kwargs)


def to_paro(config: Trainer.Config, **paro: Any) -> ParoTrainer.Config:
    """Any torchtitan ``Trainer.Config`` as a ``ParoTrainer.Config`` with a ``paro`` section."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return ParoTrainer.Config(**values, paro=ParoConfig(**paro))


def _llama3(name: str) -> ParoTrainer.Config:
    from torchtitan.models.llama3 import config_registry

    return to_paro(getattr(config_registry, name)())


# torchtitan's Llama 3 configs of the same name with PaRO IIG in groups of 8 (one node)
def llama3_debug_paro() -> ParoTrainer.Config:
    return _llama3("llama3_debugmodel")


def llama3_8b_paro() -> ParoTrainer.Config:
    return _llama3("llama3_8b")


def llama3_70b_paro() -> ParoTrainer.Config:
    return _llama3("llama3_70b")
