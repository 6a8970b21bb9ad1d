"""The trainer's configuration: one dataclass per TOML section, torchtitan v0.2 names.

Sources, later ones winning: the dataclass defaults, the TOML file (``--job.config_file``),
then CLI overrides in torchtitan's form ``--section.key value`` (``--section.key=value``;
booleans also as a bare ``--section.flag`` or ``--section.flag false``; lists as ``a,b,c``;
the ``paro_policy`` table as ``pattern=STRATEGY,pattern=STRATEGY``).

Why so strict: a typo in a long-running job's config (``--training.step 1000``) must stop it
at start-up, not hours later, so every unknown section or key, every wrong type and every
impossible combination raises :class:`ConfigError` with one line that names the key and the
valid choices. ``train.py`` prints that line and exits with status 2.

This module does not import torch, so parsing and ``--print-config`` stay fast.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

FLAVOR_NAMES = ("debug", "llama7b", "llama13b", "llama65b")  # paro_fsdp.models.llama.FLAVORS
MODEL_NAMES = ("llama", "hf")


class ConfigError(ValueError):
    """A configuration problem, described in one line that names the key and valid choices."""


# ---------------------------------------------------------------------------------------------
# Sections. Field docstrings (the string after each field) are what --help prints.
# ---------------------------------------------------------------------------------------------
@dataclass
class Job:
    config_file: Optional[str] = None
    """TOML file the config was read from"""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: TensorBoard logs, traces, checkpoints, metrics.jsonl"""
    description: str = "default job"
    """Free text, printed at start-up"""
    fresh: bool = False
    """Start afresh: once the config is valid, rank 0 deletes what a previous run wrote in job.dump_folder (the
    checkpoint folder, TensorBoard folder, profiler traces, compile schedules and metrics.jsonl; nothing else) before
    anything is written. A config error deletes nothing. `make train` passes it unless RESUME=1"""


@dataclass
class Model:
    name: str = "llama"
    """Model family; one of: llama (this trainer's Llama, from scratch), hf (a Hugging Face model folder, model.hf_path)"""
    flavor: str = "debug"
    """Model size: debug, llama7b, llama13b, llama65b (model.name = llama)"""
    hf_path: str = ""
    """model.name = hf: the folder save_pretrained wrote (config.json + *.safetensors, one file or shards) to fine-tune"""
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
    """Optimizer run on the fp32 master shards"""
    lr: float = 8e-4
    """Peak learning rate"""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
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
    """PaRO strategy: three letters of N/I/G for P, G, OS (IIG, NIG, GGG = ZeRO-3, NNN = DDP, ...), or "auto" (the advisor picks)"""
    paro_cluster_file: str = ""
    """With paro_strategy = "auto": cluster TOML for the advisor (a preset name of paro_fsdp/cost/clusters or tools.calibrate output); empty: calibrate at start-up"""
    paro_group_size: int = -1
    """Ranks per group (m); -1: ranks per node (LOCAL_WORLD_SIZE)"""
    paro_policy: dict[str, str] = field(default_factory=dict)
    """Per-tensor strategies: fnmatch pattern over parameter names = strategy; the first match wins"""
    paro_reshard_after_forward: bool = True
    """Free gathered block parameters after forward (re-gather in backward)"""
    paro_flat_below_mb: float = 0
    """Global collectives on messages below this many MiB run as one flat collective over all
    ranks instead of PaRO-CC's intra and inter phases (0: never; measure where flat wins on your
    cluster with tools.bench.collectives)"""


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
    """blocks: each transformer block on its own, as torchtitan does (identical blocks compile
    once: the debug model's first step 81 s cold, 10 s warm, 1.6x FSDP2 + per-block compile);
    model: one forward and backward graph over all blocks, so the reorder pass can prefetch
    across blocks and the root's collectives are graph nodes too (2.4x the cold compile)"""
    passes: list[str] = field(default_factory=lambda: list(GRAPH_PASSES))
    """Graph passes to run, any of: bucketing, reorder ([] for none; inductor only). Global
    collectives are PaRO-CC (intra and inter phases) in the graph without a pass"""
    push_graph: bool = False
    """Also compile the optimizer's push of the updated parameters to P (one graph: its
    all-gathers merged into one per mesh dimension). Off by default: once per step it saves a
    few collective launches, and compiling it cost as long as a block's forward and backward
    (debug model, tools.bench.compile_time: the first step 140 s with it, 82 s without)"""
    max_prefetch_mb: float = -1
    """reorder pass: bound on gathered parameters in flight, MiB (-1: no bound, 0: no prefetch)"""
    dump_schedule: bool = False
    """Write each compiled graph's collective schedule before/after the passes (text, JSON, PNG)
    to job.dump_folder/compile, and as a TensorBoard text entry"""


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
    timeline: bool = True
    """With metrics.enable_tensorboard: draw each traced step's timeline (compute, intra and inter
    collectives, per rank) as a TensorBoard image, with its overlap and link-busy fractions as
    scalars (needs matplotlib)"""


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
    """Check every file of a checkpoint against the sizes and CRC32 checksums written with it (paro_manifest.json)
    before loading; a step-N folder without that manifest is refused (false: load it unverified), an
    initial_load_path folder without one (torchtitan's, plain DCP's) loads with a warning"""
    initial_load_path: str = ""
    """With no checkpoint to resume from: start from the model weights of this DCP folder (keys =
    parameter names, as torchtitan's model-only checkpoints, or a step-N folder of this trainer:
    its fp32 masters); the optimizer, lr schedule and data start fresh"""
    last_save_in_hf: bool = False
    """After the last step also write the weights as a Hugging Face folder (step-N-hf next to the checkpoints:
    config.json + safetensors that AutoModelForCausalLM.from_pretrained loads; with [peft], the adapter folder
    step-N-hf-adapter that PeftModel.from_pretrained loads)"""
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
    """Debug: before each collective of one step, compare it (kind, mesh dimension, shape, dtype)
    across ranks and stop at the first difference with one line, instead of hanging (the first
    step; with compile.enable the second, after compiling). One small gloo all-gather per collective"""


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


# ---------------------------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------------------------
def _hints(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in get_args(tp))
    if origin is typing.Union:
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _type_name(inner[0]) + " (or unset)"
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "a table of pattern = strategy strings"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _check(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to ``tp`` or raise ConfigError naming ``key``."""
    origin = get_origin(tp)
    bad = ConfigError(f"{key} = {_show(value)} has the wrong type; valid: {_type_name(tp)}")
    if origin is typing.Union:
        if value is None:
            return None
        inner = [a for a in get_args(tp) if a is not type(None)][0]
        return _check(key, value, inner)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key} = {_show(value)} is not a valid choice; valid: {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_check(f"{key}[{i}]", v, get_args(tp)[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return {str(k): _check(f"{key}.{k}", v, str) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")  # a bug in this module


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, bool, int, float, type(None), list, dict)) else repr(value)


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _from_cli(key: str, text: str, tp: Any) -> Any:
    """Turn a CLI string into a value of ``tp`` (then checked by :func:`_check`)."""
    origin = get_origin(tp)
    if origin is typing.Union:
        if text.lower() in ("none", "null", ""):
            return None
        return _from_cli(key, text, [a for a in get_args(tp) if a is not type(None)][0])
    if tp is bool:
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"--{key} {text!r} is not a boolean; valid: true or false")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--{key} {text!r} has the wrong type; valid: an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--{key} {text!r} has the wrong type; valid: a number") from None
    if origin is list:
        return [_from_cli(key, part.strip(), get_args(tp)[0]) for part in text.split(",") if part.strip()]
    if origin is dict:
        out = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in item:
                raise ConfigError(f"--{key} item {item!r} is not pattern=STRATEGY; valid: e.g. 'output.*=NIG,default=IIG'")
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
        return out
    return text  # str and Literal


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _set(cfg: JobConfig, section: str, key: str, value: Any, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section [{section}] in {source}; valid sections: {', '.join(SECTIONS)}")
    hints = _hints(section)
    if key not in hints:
        raise ConfigError(f"unknown key {section}.{key} in {source}; valid keys of [{section}]: {', '.join(hints)}")
    setattr(getattr(cfg, section), key, _check(f"{section}.{key}", value, hints[key]))


def load_toml(cfg: JobConfig, path: str) -> None:
    """Apply a TOML file to ``cfg`` (every section and key checked)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"job.config_file = {path!r} does not exist; valid: the path of a TOML file, e.g. train_configs/debug_paro.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"job.config_file = {path!r} is not valid TOML: {exc}") from None
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}] in {path}; valid sections: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {path} must be a [section] table; valid sections: {', '.join(SECTIONS)}")
        for key, value in table.items():
            _set(cfg, section, key, value, path)
    cfg.job.config_file = path


@dataclass
class CliArgs:
    """What ``train.py`` was asked to do besides training."""

    print_config: bool = False
    estimate: bool = False
    world: Optional[int] = None
    help: bool = False
    check_config: bool = False


def parse_args(argv: list[str], world_size: Optional[int] = None, local_world_size: Optional[int] = None) -> tuple[JobConfig, CliArgs]:
    """Build the config from defaults, ``--job.config_file`` and CLI overrides, then validate it
    for ``world_size`` ranks (default: $WORLD_SIZE, or 1)."""
    cli = CliArgs()
    overrides: list[tuple[str, str, Optional[str]]] = []  # (section, key, text or None for a bare flag)
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            cli.help = True
            continue
        if arg == "--print-config":
            cli.print_config = True
            continue
        if arg == "--estimate":
            cli.estimate = True
            continue
        if arg == "--check-config":
            cli.check_config = True
            continue
        if arg.startswith("--world"):
            text = arg.split("=", 1)[1] if "=" in arg else (argv[i] if i < len(argv) else "")
            i += 0 if "=" in arg else 1
            try:
                cli.world = int(text)
            except ValueError:
                raise ConfigError(f"--world {text!r} must be an integer (the number of ranks to estimate for)") from None
            continue
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"unexpected argument {arg!r}; valid: --section.key value (sections: {', '.join(SECTIONS)}), "
                "--print-config, --check-config [--world N], --estimate [--world N], --help"
            )
        name, eq, text = arg[2:].partition("=")
        section, _, key = name.partition(".")
        if section not in SECTIONS:
            raise ConfigError(f"unknown option --{name}: no section [{section}]; valid sections: {', '.join(SECTIONS)}")
        hints = _hints(section)
        if key not in hints:
            raise ConfigError(f"unknown option --{name}; valid keys of [{section}]: {', '.join(hints)}")
        if not eq:
            tp = hints[key]
            nxt = argv[i] if i < len(argv) else None
            if tp is bool:
                if nxt is not None and not nxt.startswith("--"):
                    text, i = nxt, i + 1
                else:
                    text = "true"
            else:
                if nxt is None or (nxt.startswith("--") and len(nxt) > 2):
                    raise ConfigError(f"--{name} needs a value; valid: {_type_name(tp)}")
                text, i = nxt, i + 1
        if name == "job.config_file":
            config_file = text
        else:
            overrides.append((section, key, text))
    dataset_on_cli = any((s, k) == ("training", "dataset") for s, k, _ in overrides)

    cfg = JobConfig()
    if config_file is not None:
        load_toml(cfg, config_file)
    for section, key, text in overrides:
        tp = _hints(section)[key]
        _set(cfg, section, key, _from_cli(f"{section}.{key}", text, tp), "the command line")
    imply_dataset(cfg, dataset_on_cli)
    if world_size is None:  # unknown before torchrun: the trainer validates again once it knows
        if (cli.estimate or cli.check_config) and cli.world:
            world_size = cli.world
        elif "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
    if local_world_size is None and world_size is not None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if not cli.estimate else min(8, world_size)
    validate(cfg, world_size, local_world_size, for_training=not (cli.estimate or cli.print_config))
    return cfg, cli


# ---------------------------------------------------------------------------------------------
# Combinations
# ---------------------------------------------------------------------------------------------
def imply_dataset(cfg: JobConfig, dataset_on_cli: bool) -> None:
    """``training.dataset_path`` with ``dataset = "embedded"`` (the default, or a config file's):
    the path names the data to train on (as in torchtitan, where dataset_path is where the named
    dataset is read from and is never ignored), so it sets ``dataset`` to "jsonl" for a .jsonl /
    .json file (or a folder holding only such files), else "text". Both typed on the command line
    is a contradiction: ConfigError."""
    t = cfg.training
    if not t.dataset_path or t.dataset != "embedded":
        return
    if dataset_on_cli:
        raise ConfigError(f"training.dataset_path = {_show(t.dataset_path)} is read only with training.dataset = \"text\" "
                          f"or \"jsonl\", and the command line also says --training.dataset embedded; valid: drop one "
                          f"of the two (a path alone implies text, or jsonl for .jsonl files)")
    jsonl, text = (".jsonl", ".json"), (".txt", ".md", ".rst", ".text")  # data.JSONL_SUFFIXES, data.TEXT_SUFFIXES
    path = t.dataset_path
    if os.path.isdir(path):
        suffixes = {os.path.splitext(f)[1].lower() for _, _, files in os.walk(path) for f in files}
        t.dataset = "jsonl" if suffixes & set(jsonl) and not suffixes & set(text) else "text"
    else:
        t.dataset = "jsonl" if path.lower().endswith(jsonl) else "text"


def _is_strategy(text: str) -> bool:
    return isinstance(text, str) and len(text.strip()) == 3 and all(c in "NIG" for c in text.strip().upper())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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


def validate(cfg: JobConfig, world_size: Optional[int], local_world_size: Optional[int] = None, for_training: bool = True) -> None:
    """Raise ConfigError for values that are well-typed but impossible (for ``world_size`` ranks).
    ``world_size=None`` skips the checks that need it; ``for_training=False`` (``--estimate``,
    ``--print-config``) skips what only matters when the model really runs."""

    def positive(key: str, value: float, allow_zero: bool = False) -> None:
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{key} = {_show(value)} must be {'>= 0' if allow_zero else '> 0'}")

    m, t, p = cfg.model, cfg.training, cfg.parallelism
    if m.name not in MODEL_NAMES:
        raise ConfigError(f"model.name = {_show(m.name)} is not a known model; valid: {', '.join(MODEL_NAMES)}")
    if m.flavor not in FLAVOR_NAMES:
        raise ConfigError(f"model.flavor = {_show(m.flavor)} is not a known flavor; valid: {', '.join(FLAVOR_NAMES)}")
    if m.name == "hf" and not m.hf_path:
        raise ConfigError("model.name = \"hf\" needs model.hf_path; valid: the folder save_pretrained wrote "
                          "(config.json + *.safetensors)")
    if m.name != "hf" and m.hf_path:
        raise ConfigError(f"model.hf_path = {_show(m.hf_path)} is read only with model.name = \"hf\"; valid: "
                          f"--model.name hf, or no model.hf_path")
    if m.name == "hf" and m.vocab_size != -1:
        raise ConfigError(f"model.vocab_size = {m.vocab_size}: a Hugging Face model's vocabulary is its config.json's; "
                          f"valid: -1 with model.name = \"hf\"")
    pf = cfg.peft
    if pf.lora_rank < 0:
        raise ConfigError(f"peft.lora_rank = {pf.lora_rank} is invalid; valid: 0 (no LoRA) or a positive rank, e.g. 8")
    if pf.lora_rank and m.name != "hf":
        raise ConfigError("peft.lora_rank > 0 fine-tunes a Hugging Face model; valid: --model.name hf --model.hf_path DIR, "
                          "or peft.lora_rank = 0")
    positive("peft.lora_alpha", pf.lora_alpha)
    if not 0.0 <= pf.lora_dropout < 1.0:
        raise ConfigError(f"peft.lora_dropout = {pf.lora_dropout} is out of range; valid: a number in [0, 1)")
    if m.vocab_size != -1 and m.vocab_size < 1:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is invalid; valid: -1 (from flavor and tokenizer) or a positive integer")
    for key in ("local_batch_size", "seq_len", "steps"):
        positive(f"training.{key}", getattr(t, key))
    positive("optimizer.lr", cfg.optimizer.lr)
    positive("optimizer.eps", cfg.optimizer.eps)
    positive("optimizer.weight_decay", cfg.optimizer.weight_decay, allow_zero=True)
    positive("lr_scheduler.warmup_steps", cfg.lr_scheduler.warmup_steps, allow_zero=True)
    positive("training.max_consecutive_skips", t.max_consecutive_skips, allow_zero=True)
    if not 0.0 <= cfg.lr_scheduler.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor = {cfg.lr_scheduler.min_lr_factor} is out of range; valid: a number in [0, 1]")
    if cfg.lr_scheduler.decay_ratio is not None and not 0.0 <= cfg.lr_scheduler.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio = {cfg.lr_scheduler.decay_ratio} is out of range; valid: unset or a number in [0, 1]")
    if t.dataset in ("text", "jsonl") and not t.dataset_path:
        raise ConfigError(f"training.dataset_path is required when training.dataset = {_show(t.dataset)}; valid: a file or folder path")
    init = cfg.checkpoint.initial_load_path
    if init and not os.path.isdir(init):
        raise ConfigError(f"checkpoint.initial_load_path = {_show(init)} does not exist; valid: \"\" or a DCP checkpoint "
                          f"folder (e.g. a step-N folder)")
    if t.dataset_path and not os.path.exists(t.dataset_path):
        raise ConfigError(f"training.dataset_path = {_show(t.dataset_path)} does not exist; valid: an existing file or folder")
    per_step = t.local_batch_size * (world_size or 1)
    if world_size is not None and t.global_batch_size != -1 and (t.global_batch_size < per_step or t.global_batch_size % per_step):
        examples = ", ".join(str(per_step * k) for k in (1, 2, 4))
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} is not a multiple of training.local_batch_size "
            f"({t.local_batch_size}) x data-parallel ranks ({world_size}) = {per_step}; valid: -1 or a multiple of {per_step} (e.g. {examples})"
        )
    if p.paro_strategy.strip().lower() == "auto":
        if p.paro_policy:
            raise ConfigError("parallelism.paro_strategy = \"auto\" cannot be combined with parallelism.paro_policy "
                              "(the advisor picks one strategy for the whole model); valid: an explicit strategy, or no paro_policy")
    elif not _is_strategy(p.paro_strategy):
        raise ConfigError(
            f"parallelism.paro_strategy = {_show(p.paro_strategy)} is not a PaRO strategy; valid: three letters of N, I, G "
            "for the P, G, OS levels, e.g. IIG, NIG, IGG, ING, GGG (ZeRO-3), NNG (ZeRO-1), NNN (DDP)"
        )
    for pattern, strategy in p.paro_policy.items():
        if not _is_strategy(strategy):
            raise ConfigError(
                f"parallelism.paro_policy.{pattern} = {_show(strategy)} is not a PaRO strategy; valid: three letters of N, I, G, e.g. IIG"
            )
    if p.paro_flat_below_mb < 0:
        raise ConfigError(f"parallelism.paro_flat_below_mb = {p.paro_flat_below_mb} is invalid; valid: 0 (never flat) "
                          "or a positive size in MiB")
    if p.paro_group_size != -1 and p.paro_group_size < 1:
        raise ConfigError(f"parallelism.paro_group_size = {p.paro_group_size} is invalid; valid: -1 (ranks per node) or a positive divisor of the world size")
    if p.paro_group_size != -1 and world_size is not None:
        if world_size % p.paro_group_size:
            raise ConfigError(
                f"parallelism.paro_group_size = {p.paro_group_size} does not divide the world size {world_size}; "
                f"valid: -1 (ranks per node) or one of {_divisors(world_size)}"
            )
    if "hierarchical" in cfg.compile.passes:
        raise ConfigError("compile.passes: 'hierarchical' is no longer a pass: compiled graphs run global collectives "
                          "as PaRO-CC (intra and inter phases) as the eager engine does; drop it, "
                          f"valid: any of {list(GRAPH_PASSES)}")
    unknown = [name for name in cfg.compile.passes if name not in GRAPH_PASSES]
    if unknown:
        raise ConfigError(f"compile.passes has unknown pass(es) {unknown}; valid: any of {list(GRAPH_PASSES)}")
    if cfg.compile.backend not in ("inductor", "aot_eager", "eager"):
        raise ConfigError(f"compile.backend = {cfg.compile.backend!r} is invalid; valid: inductor, aot_eager, eager")
    if cfg.compile.max_prefetch_mb < 0 and cfg.compile.max_prefetch_mb != -1:
        raise ConfigError(f"compile.max_prefetch_mb = {cfg.compile.max_prefetch_mb} is invalid; valid: -1 (no bound) or >= 0")
    positive("metrics.log_freq", cfg.metrics.log_freq)
    positive("profiling.profile_freq", cfg.profiling.profile_freq)
    positive("profiling.keep_latest_k", cfg.profiling.keep_latest_k, allow_zero=True)
    positive("checkpoint.interval", cfg.checkpoint.interval)
    positive("checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k, allow_zero=True)
    if cfg.checkpoint.load_step < -1:
        raise ConfigError(f"checkpoint.load_step = {cfg.checkpoint.load_step} is invalid; valid: -1 (latest) or a saved step")
    positive("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)
    positive("comm.train_timeout_seconds", cfg.comm.train_timeout_seconds)


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------
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


def help_text() -> str:
    """Every key with its type, default and description (``train.py --help``)."""
    import ast
    import inspect

    out = [
        "usage: torchrun --nproc-per-node N train.py --job.config_file FILE.toml [--section.key value ...]",
        "       python train.py --job.config_file FILE.toml --print-config | --check-config [--world N] | --estimate --world N",
        "",
        "exit status: 0 trained (or stopped by SIGTERM / SIGINT after saving the step it reached), 2 a configuration",
        "error (one line on stderr), 1 anything else (a failed rank or collective, a checkpoint problem). Under",
        "torchrun the trainer's line comes first and torchrun's own status is 1 whenever a rank failed or torchrun",
        "itself was signalled (its ChildFailedError summary then names rank 0's exit status 2 for a configuration error).",
        "--check-config validates for --world N ranks (default $WORLD_SIZE, else 1) and exits 0 or 2 without training.",
        "",
    ]
    defaults = JobConfig()
    for section, cls in SECTIONS.items():
        docs: dict[str, str] = {}
        try:
            body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[a.target.id] = str(b.value.value)  # type: ignore[union-attr]
        except (OSError, TypeError):
            pass
        out.append(f"[{section}]")
        for key, tp in _hints(section).items():
            default = getattr(getattr(defaults, section), key)
            out.append(f"  --{section}.{key} ({_type_name(tp)}; default {_show(default)})  {docs.get(key, '')}".rstrip())
    return "\n".join(out)
