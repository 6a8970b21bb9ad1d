"""The trainer's configuration schema: one dataclass per TOML section, torchtitan v0.2 names.

Reading, checking and ``--help`` live in ``config_parse.py`` (as torchtitan keeps its schema
apart from its parsing). The string after each field is what ``--help`` prints. No torch import.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

FLAVOR_NAMES = ("debug", "llama7b", "llama13b", "llama65b")  # paro_fsdp.models.llama.FLAVORS
MODEL_NAMES = ("llama", "hf")
TEXT_SUFFIXES, JSONL_SUFFIXES = (".txt", ".md", ".rst", ".text"), (".jsonl", ".json")  # dataset = text / jsonl files


class ConfigError(ValueError):
    """A configuration problem, described in one line that names the key and valid choices."""


@dataclass
class Job:
    config_file: Optional[str] = None
    """TOML file the config was read from"""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: TensorBoard logs, traces, checkpoints, metrics.jsonl"""
    description: str = "default job"
    """Free text, printed at start-up"""
    fresh: bool = False
    """Once the config is valid, delete what a previous run wrote in job.dump_folder (checkpoints, TensorBoard,
    traces, compile schedules, metrics.jsonl; nothing else). `make train` passes it unless RESUME=1"""


@dataclass
class Model:
    name: str = "llama"
    """Model family; one of: llama (this trainer's Llama, from scratch), hf (a Hugging Face model folder,
    model.hf_path)"""
    flavor: str = "debug"
    """Model size: debug, llama7b, llama13b, llama65b (model.name = llama)"""
    hf_path: str = ""
    """model.name = hf: the folder save_pretrained wrote (config.json + *.safetensors, one file or shards) to
    fine-tune"""
    tokenizer: str = "auto"
    """"auto" (model.name = llama: "byte"; hf: the tokenizer.json of model.hf_path), "byte" (UTF-8 bytes + BOS/EOS,
    258 ids) or the path of a HuggingFace tokenizer.json"""
    vocab_size: int = -1
    """Embedding rows; -1: the flavor's, widened to the tokenizer's vocabulary if that is larger"""


@dataclass
class Peft:
    lora_rank: int = 0
    """LoRA adapters (peft) of this rank on a model.name = hf model, its base weights frozen; 0: train every weight"""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank)"""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input"""
    target_modules: list[str] = field(default_factory=list)
    """Module names the adapters wrap; []: peft's default for the architecture (its attention projections: q_proj,
    v_proj for Llama and Qwen2, c_attn for GPT-2)"""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """torch optimizer over the model's parameters (the fp32 masters, sharded at their OS level)"""
    lr: float = 8e-4
    """Peak learning rate"""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """On matrices and embeddings (ndim >= 2); norms' gains and biases are not decayed"""
    implementation: Literal["for-loop", "foreach", "fused"] = "foreach"
    """torch.optim implementation"""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup steps"""
    decay_ratio: Optional[float] = None
    """Fraction of steps spent decaying at the end (warmup-stable-decay); unset: decay right after warmup"""
    decay_type: Literal["linear", "sqrt", "cosine", "constant"] = "linear"
    """Shape of the decay; constant keeps the peak lr after warmup"""
    min_lr_factor: float = 0.0
    """The decay ends at lr * min_lr_factor"""


@dataclass
class Training:
    dataset: Literal["embedded", "text", "jsonl"] = "embedded"
    """embedded: the shipped corpus; text: .txt/.md/.rst files; jsonl: JSON lines with a "text" field"""
    dataset_path: Optional[str] = None
    """File or folder for dataset = text / jsonl; given with dataset = "embedded" (the default, or a config file's), it
    implies dataset = "jsonl" for a .jsonl/.json file (or a folder holding only those), else "text" """
    local_batch_size: int = 8
    """Sequences per rank per micro-step"""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1: local_batch_size x ranks (no accumulation)"""
    seq_len: int = 2048
    """Tokens per sequence (windows of seq_len + 1 tokens are packed from the stream)"""
    max_norm: float = 1.0
    """Gradient clipping on the global norm; <= 0 disables clipping (the norm is still logged)"""
    steps: int = 10000
    """Optimizer steps to train"""
    seed: int = 42
    """Seed of model init and data order (the same on every rank)"""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True)"""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of parameters P (all-gathers, compute); the optimizer's master copy is fp32"""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype gradients travel in (reduce-scatters, all-reduces)"""
    mixed_precision_accumulate: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient accumulator G summed over micro-steps (bfloat16 halves G memory but
    rounds away part of late micro-steps' gradients)"""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A NaN or inf loss or gradient norm: skip that optimizer step (log it, keep the weights) or stop the run"""
    max_consecutive_skips: int = 5
    """Stop after this many non-finite steps in a row (on_nonfinite = "skip"); 0: never stop"""


@dataclass
class Parallelism:
    paro_strategy: str = "IIG"
    """PaRO strategy: three letters of N/I/G for P, G, OS (IIG, NIG, GGG = ZeRO-3, NNN = DDP, ...), or "auto" (the
    advisor picks)"""
    memory_budget_gib: float = 0
    """With paro_strategy = "auto": memory per rank in GiB; the plan takes a strategy per block (embeddings and
    head, each transformer block; frozen and trainable tensors apart), the fastest predicted within it; 0: one
    strategy for the whole model, the fastest that fits the cluster's memory"""
    paro_cluster_file: str = ""
    """With paro_strategy = "auto": cluster TOML for the advisor (a preset name of paro_fsdp/cost/clusters or
    tools.calibrate output); empty: calibrate at start-up"""
    paro_group_size: int = -1
    """Ranks per group (m); -1: ranks per node (LOCAL_WORLD_SIZE)"""
    paro_policy: dict[str, str] = field(default_factory=dict)
    """Per-tensor strategies: fnmatch pattern over parameter names = strategy; the first match wins"""
    paro_reshard_after_forward: bool = True
    """Free gathered block parameters after forward (re-gather in backward)"""
    paro_flat_below_mb: float = 0
    """Global collectives below this many MiB run flat over all ranks instead of PaRO-CC's intra
    and inter phases (0: never; tools.bench.collectives measures where flat wins)"""
    inter_dtype: Literal["none", "int8", "int4"] = "none"
    """What crosses between groups, quantized with block-wise scales: int8 (parameters and gradients), int4
    (gradients; parameters int8); none: exact. Inside a group nothing changes (docs/api.md)"""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full"] = "none"
    """full: recompute each transformer block's forward in backward (torch.utils.checkpoint)"""


GRAPH_PASSES = ("bucketing", "reorder")  # passes.ORDER (kept here: no torch import)


@dataclass
class Compile:
    enable: bool = False
    """torch.compile the model (its collectives in the graph; see passes/)"""
    backend: str = "inductor"
    """torch.compile backend: inductor (the graph passes run in it), aot_eager or eager"""
    scope: Literal["model", "blocks"] = "blocks"
    """blocks: each block on its own, as torchtitan (identical blocks compile once); model: one graph,
    so reorder can prefetch across blocks (a longer cold compile; docs/benchmarks.md)"""
    passes: list[str] = field(default_factory=lambda: list(GRAPH_PASSES))
    """Graph passes to run, any of: bucketing, reorder ([] for none; inductor only)"""
    push_graph: bool = False
    """Also compile the push of the updated parameters to P after each optimizer step (traced._compile_push;
    off: it saves a few launches per step for about a block's compile time; docs/benchmarks.md)"""
    max_prefetch_mb: float = -1
    """reorder pass: bound on gathered parameters in flight, MiB (-1: no bound, 0: no prefetch)"""
    dump_schedule: bool = False
    """Write each graph's collective schedule before/after the passes to job.dump_folder/compile and TensorBoard"""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log one line (and TensorBoard scalars) every log_freq steps"""
    enable_tensorboard: bool = False
    save_tb_folder: str = "tb"
    """TensorBoard folder, under job.dump_folder"""


@dataclass
class Profiling:
    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    """torch.profiler traces (tensorboard_trace_handler), under job.dump_folder"""
    profile_freq: int = 10
    """Trace one step every profile_freq steps (a checkpoint save after a traced step is not in its trace)"""
    keep_latest_k: int = 3
    """Keep each rank's newest k trace files (older ones are deleted as new ones are written); 0 keeps all"""
    traced_micro_steps: int = 2
    """Micro-steps of a profiled step that are traced: the first ones and the last, which holds the step boundary
    (clip, optimizer step); collection pauses in between, bounding the trace and its stop and export. 0 = all"""
    timeline: bool = True
    """With metrics.enable_tensorboard: each traced step's timeline (compute, intra and inter collectives, per
    rank) as a TensorBoard image, its overlap and link-busy fractions as scalars (needs matplotlib)"""


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"
    """Checkpoint folder, under job.dump_folder"""
    interval: int = 500
    """Save every interval steps (and after the last step)"""
    keep_latest_k: int = 10
    """Keep the newest k checkpoints; 0 keeps all"""
    load_step: int = -1
    """Resume from this step's checkpoint; -1: the latest complete one (if any)"""
    verify: bool = True
    """Check a checkpoint's files against its paro_manifest.json (sizes, CRC32) before loading; a step-N folder
    without one is refused (false: load it unverified), an initial_load_path one loads with a warning"""
    initial_load_path: str = ""
    """With no checkpoint to resume from: the model weights of this DCP folder (torchtitan's model-only, or a
    step-N folder: its fp32 masters); optimizer, lr schedule and data start fresh"""
    last_save_in_hf: bool = False
    """After the last step also write step-N-hf beside the checkpoints, which AutoModelForCausalLM.from_pretrained
    loads (with [peft]: step-N-hf-adapter, for PeftModel.from_pretrained)"""
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the weights checkpoint.last_save_in_hf writes"""


@dataclass
class Comm:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl when CUDA is available, else gloo (CPU)"""
    init_timeout_seconds: int = 300
    """Collective timeout during start-up and the first step"""
    train_timeout_seconds: int = 100
    """Collective timeout after the first step"""
    check_collective_order: bool = False
    """Debug: compare each collective of one step (the first; compiled: the second) across ranks, stopping at the
    first difference with one line instead of hanging; one small gloo all-gather per collective"""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    peft: Peft = field(default_factory=Peft)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return to_toml(self)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


def tokenizer_spec(cfg: JobConfig) -> str:
    """What ``model.tokenizer = "auto"`` means for this model: bytes for the trainer's Llama, the
    model folder (its tokenizer.json) for a Hugging Face model."""
    spec = cfg.model.tokenizer
    if spec == "auto":
        return cfg.model.hf_path if cfg.model.name == "hf" else "byte"
    return spec


def group_size(cfg: JobConfig, world_size: int, local_world_size: Optional[int] = None) -> int:
    """The resolved paro group size (-1 -> ranks per node)."""
    m = cfg.parallelism.paro_group_size
    if m == -1:
        m = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        m = m if world_size % m == 0 else world_size
    return m


def grad_accum_steps(cfg: JobConfig, world_size: int) -> int:
    t = cfg.training
    gbs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * world_size
    return gbs // (t.local_batch_size * world_size)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def to_toml(cfg: JobConfig) -> str:
    """The merged config as TOML that :func:`load_toml` reads back to the same values."""
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        tables = []
        for key, v in values.items():
            if v is None:
                lines.append(f"# {key} = (unset)")
            elif isinstance(v, dict):
                tables.append((key, v))
            else:
                lines.append(f"{key} = {_toml_value(v)}")
        for key, table in tables:
            lines.append(f"[{section}.{key}]")
            lines.extend(f"{json.dumps(k)} = {_toml_value(val)}" for k, val in table.items())
        lines.append("")
    return "\n".join(lines)

