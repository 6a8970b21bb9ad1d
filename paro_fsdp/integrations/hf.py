"""Hugging Face causal LMs, and peft LoRA adapters on them, under ``paro_shard`` (extra ``paro-fsdp[hf]``):
a model folder in, the trained weights out as a folder transformers loads (docs/huggingface.md).

Why built on the meta device and loaded in place: ``from_pretrained`` on every rank holds the model n
times; here each rank reads its safetensors slices straight into the parameters (``safe_load``), so no
rank holds the whole model and the fp32 masters are exact.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor

from paro_fsdp.checkpoint_files import first_line, safe_load

__all__ = ["HFModelError", "read_config", "weight_files", "build_meta", "decoder_blocks", "add_lora",
           "init_for_load", "materialise_buffers", "check_weights", "parameters_state", "load_weights",
           "architecture", "save_model", "save_adapter", "base_name", "count_trainable", "SHARD_BYTES"]

SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


class HFModelError(ValueError):
    """A model folder or LoRA setting that cannot work, in one line naming the fix."""


# ---- the folder -------------------------------------------------------------------------------
def read_config(path: str) -> Any:
    """The folder's ``config.json`` as a known causal-LM config, read as data: never a model's own code."""
    if not os.path.isdir(path):
        raise HFModelError(f"model.hf_path = {path!r} is not a folder; valid: a model folder as save_pretrained "
                           f"writes it (config.json and *.safetensors)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise HFModelError(f"model.hf_path = {path!r} has no config.json; valid: a folder save_pretrained wrote "
                           f"(e.g. AutoModelForCausalLM.from_pretrained(NAME).save_pretrained({path!r}))")
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise HFModelError(f"{path}/config.json is not a JSON object ({first_line(exc)}); valid: the config.json "
                           f"save_pretrained writes") from None
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise HFModelError(f"{path}/config.json: model_type {model_type!r} is not an architecture transformers "
                           f"{transformers.__version__} knows ({first_line(exc)}); valid: a model transformers "
                           f"implements (llama, qwen2, mistral, gpt2, ...), or a newer transformers "
                           f"(pip install -U transformers); code shipped with a model is never run") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise HFModelError(f"{path}/config.json: model_type {config.model_type!r} has no causal language model in "
                           f"transformers {transformers.__version__} (AutoModelForCausalLM); valid: a decoder LM "
                           f"such as llama, qwen2, mistral, gpt2")
    return config


def weight_files(path: str) -> list[str]:
    """The folder's ``*.safetensors`` (one file, or the shards of ``max_shard_size``)."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        pickled = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (f" ({pickled[0]} is a pickle, which is never read: it can run code)" if pickled else "")
        raise HFModelError(f"model.hf_path = {path!r} holds no *.safetensors{hint}; valid: a folder save_pretrained "
                           f"wrote, whose weights are safetensors (transformers' default)")
    return files


def build_meta(config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` on the meta device, in fp32: the masters' dtype."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _pretrained(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (or the model itself)."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks for ``paro_shard(blocks=)``: the default would make each ``ModuleDict`` peft adds a block."""
    names = set(getattr(_pretrained(model), "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if type(m).__name__ in names:
            blocks.append(m)
            inside |= {id(x) for x in m.modules()}
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise HFModelError(f"{type(model).__name__}: no transformer blocks found (no _no_split_modules, no ModuleList)")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


# ---- LoRA -------------------------------------------------------------------------------------
def _linear_names(model: nn.Module) -> list[str]:
    """Distinct last names of the modules LoRA could wrap (for error messages)."""
    return list(dict.fromkeys(name.rpartition(".")[2] for name, m in model.named_modules()
                              if name and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")))


def add_lora(model: nn.Module, rank: int, alpha: float = 16.0, dropout: float = 0.0,
             target_modules: Optional[Iterable[str]] = None, base_path: str = "") -> nn.Module:
    """peft's ``get_peft_model`` before ``paro_shard``: frozen base weights get no gradient or optimizer
    state. No ``target_modules``: peft's default for the architecture (Llama's q / v projections)."""
    from peft import LoraConfig, get_peft_model

    targets = list(target_modules) if target_modules else None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        task_type="CAUSAL_LM", base_model_name_or_path=base_path or None)
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model", or no default
        what = f"= {targets} matches no module of" if targets else "has no default in peft for"
        raise HFModelError(f"peft.target_modules {what} {type(model).__name__} ({first_line(exc)[:120]}); valid: "
                           f"names of its linear layers, e.g. {','.join(_linear_names(model)[:8])}") from None


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter elements."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def init_for_load(seed: int) -> Callable[[str, torch.Tensor], None]:
    """``param_init_fn`` before ``load_weights``: zeros, adapters drawn as peft does, seeded by (seed, name)."""

    def init(name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            gen = torch.Generator(device=tensor.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if ".lora_A." in name:
                nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=gen)
            elif ".lora_embedding_B." in name:
                nn.init.normal_(tensor, generator=gen)
            else:
                tensor.zero_()

    return init


def materialise_buffers(model: nn.Module, device: torch.device) -> None:
    """Meta buffers (RoPE's ``inv_freq``) filled on ``device`` by ``_init_weights``; one it leaves is refused."""
    pretrained = _pretrained(model)
    for name, module in model.named_modules():
        meta = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        if any(p is not None for p in module._parameters.values()):
            raise HFModelError(f"{name} ({type(module).__name__}) has buffers {meta} that transformers initialises "
                               f"with the module's parameters; not supported on the meta device")
        for k in meta:
            module._buffers[k] = torch.full_like(module._buffers[k], float("nan"), device=device)
        pretrained._init_weights(module)
        for k in meta:
            b = module._buffers[k]
            if b.is_floating_point() and torch.isnan(b).any():
                raise HFModelError(f"buffer {name}.{k} of {type(module).__name__}: transformers' _init_weights does "
                                   f"not compute it on a model built on the meta device; not supported")


# ---- loading: each rank reads its shards ---------------------------------------------------------
def base_name(fqn: str) -> Optional[str]:
    """A parameter's name in the base model's safetensors (peft's wrapping dropped); None for the adapters."""
    if ".lora_" in fqn or ".lora_magnitude_vector" in fqn:
        return None
    return fqn.removeprefix("base_model.model.").replace(".base_layer.", ".")


def check_weights(names: dict[str, tuple[int, ...]], path: str,
                  key: Callable[[str], Optional[str]] = base_name) -> None:
    """``HFModelError`` unless the folder holds every tensor of ``names`` with its shape (headers only)."""
    weight_files(path)
    stored = {k: tuple(m.size) for k, m in HuggingFaceStorageReader(path).read_metadata().state_dict_metadata.items()}
    wanted = {key(n): tuple(s) for n, s in names.items() if key(n) is not None}
    missing = [n for n in wanted if n not in stored]
    if missing:
        raise HFModelError(f"model.hf_path = {path!r} lacks {len(missing)} of the {len(wanted)} tensors its "
                           f"config.json describes, e.g. {missing[0]}; valid: a folder whose safetensors match its "
                           f"config.json (as save_pretrained writes them)")
    for n, shape in wanted.items():
        if stored[n] != shape:
            raise HFModelError(f"model.hf_path = {path!r}: {n} is {list(stored[n])} in the safetensors, {list(shape)} "
                               f"by its config.json; valid: a folder whose safetensors match its config.json")


def parameters_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters by name (a tied tensor once), detached: DCP writes and loads each rank's shards in place."""
    return {name: p.detach() for name, p in model.named_parameters()}


def load_weights(model: nn.Module, path: str, key: Callable[[str], Optional[str]] = base_name) -> int:
    """Each rank's slices of the safetensors into the parameters, in place; how many. Collective."""
    params = {fqn: p for fqn, p in model.named_parameters() if key(fqn) is not None}
    targets = {key(fqn): p.detach() for fqn, p in params.items()}
    check_weights({k: tuple(v.shape) for k, v in targets.items()}, path, key=lambda n: n)
    safe_load(targets, storage_reader=HuggingFaceStorageReader(path))
    # DCP writes each local shard without moving the parameter's version counter, which the engine reads
    torch.autograd.graph.increment_version(list(params.values()))
    return len(targets)


# ---- the export -------------------------------------------------------------------------------
def _export(values: dict[str, DTensor], out_dir: str, dtype: torch.dtype, max_bytes: int,
            finish: Callable[[str], None]) -> str:
    """Every rank's shards into ``out_dir.tmp``; rank 0 joins them into files and index, calls ``finish`` and
    renames it into place (a crash leaves only ``.tmp``). Collective."""
    tmp = out_dir.rstrip("/") + ".tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    barrier = dist.barrier if dist.is_initialized() else lambda: None
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    state = {k: v.to(dtype) for k, v in values.items()}
    # tensor -> file 1..k in order, each at most max_bytes (a larger tensor alone), as save_pretrained splits
    index, size, files = 1, 0, {}
    for name, v in state.items():
        nbytes = v.numel() * dtype.itemsize
        if size and size + nbytes > max_bytes:
            index, size = index + 1, 0
        files[name], size = index, size + nbytes
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(tmp, fqn_to_index_mapping=files, save_distributed=True,
                                                            enable_consolidation=True))
    barrier()
    if rank0:
        shutil.rmtree(os.path.join(tmp, "sharded"), ignore_errors=True)
        finish(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    barrier()
    return out_dir


def architecture(model: nn.Module) -> Optional[str]:
    """The model's transformers class for ``architectures``, as ``save_pretrained``'s; None for another model."""
    from transformers import PreTrainedModel

    from torch.distributed.fsdp import FSDPModule

    base = _pretrained(model)
    if not isinstance(base, PreTrainedModel):
        return None
    return next(c.__name__ for c in type(base).__mro__ if not issubclass(c, FSDPModule))


def save_model(model: nn.Module, out_dir: str, config: Any, *, dtype: torch.dtype = torch.float32,
               values: Optional[dict[str, DTensor]] = None, extra_files: Iterable[str] = (),
               max_shard_bytes: int = SHARD_BYTES) -> str:
    """A folder ``from_pretrained`` loads: ``config`` and ``values`` (default: the parameters, the fp32
    masters under bf16 too) in ``dtype``, ``extra_files`` copied in. Collective; returns ``out_dir``."""
    values = parameters_state(model) if values is None else values
    arch = architecture(model)

    def finish(folder: str) -> None:
        config.dtype = dtype
        if arch is not None:
            config.architectures = [arch]
        config.save_pretrained(folder)
        for f in extra_files:
            shutil.copy(f, folder)

    return _export(values, out_dir, dtype, max_shard_bytes, finish)


def save_adapter(model: nn.Module, out_dir: str, *, dtype: torch.dtype = torch.float32) -> str:
    """Write the LoRA adapter as peft's ``save_pretrained`` does. Collective; returns ``out_dir``."""
    from peft import get_peft_model_state_dict

    def finish(folder: str) -> None:  # one file, named as peft names it; peft reads no index
        os.rename(os.path.join(folder, "model-00001-of-00001.safetensors"),
                  os.path.join(folder, "adapter_model.safetensors"))
        os.remove(os.path.join(folder, "model.safetensors.index.json"))
        model.peft_config[model.active_adapter].save_pretrained(folder)

    adapter = get_peft_model_state_dict(model, state_dict=parameters_state(model), save_embedding_layers=False)
    return _export(adapter, out_dir, dtype, SHARD_BYTES * 100, finish)
