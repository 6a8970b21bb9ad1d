"""Reading the trainer's config (``config.py``'s schema): defaults, the TOML file, then CLI overrides
``--section.key value`` (booleans also bare; lists ``a,b,c``; ``paro_policy`` as ``pattern=STRATEGY,...``).
Why so strict: a typo in a long job's config must stop it at start-up, not hours later: every unknown key,
wrong type and impossible combination is one ConfigError line naming the key and the valid choices (exit 2).
No torch import: parsing and ``--print-config`` stay fast.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import sys
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional, get_args, get_origin

from .config import (FLAVOR_NAMES, GRAPH_PASSES, JSONL_SUFFIXES, MODEL_NAMES, SECTIONS, TEXT_SUFFIXES, ConfigError,
                     JobConfig)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _hints(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in get_args(tp))
    if origin is typing.Union:
        return _type_name([a for a in get_args(tp) if a is not type(None)][0]) + " (or unset)"
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "a table of pattern = strategy strings"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


_PLAIN = {bool: bool, int: int, float: (int, float), str: str}  # what a TOML value of each type may be


def _check(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to ``tp`` or raise ConfigError naming ``key``."""
    origin = get_origin(tp)
    bad = ConfigError(f"{key} = {_show(value)} has the wrong type; valid: {_type_name(tp)}")
    if origin is typing.Union:
        return None if value is None else _check(key, value, [a for a in get_args(tp) if a is not type(None)][0])
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
    if tp in _PLAIN:
        if not isinstance(value, _PLAIN[tp]) or (isinstance(value, bool) and tp is not bool):
            raise bad
        return float(value) if tp is float else value
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
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ConfigError(f"--{key} {text!r} is not a boolean; valid: true or false")
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            raise ConfigError(f"--{key} {text!r} has the wrong type; valid: {_type_name(tp)}") from None
    if origin is list:
        return [_from_cli(key, part.strip(), get_args(tp)[0]) for part in text.split(",") if part.strip()]
    if origin is dict:
        out = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in item:
                raise ConfigError(f"--{key} item {item!r} is not pattern=STRATEGY; valid: e.g. "
                                  f"'output.*=NIG,default=IIG'")
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
        return out
    return text  # str and Literal


def _set(cfg: JobConfig, section: str, key: str, value: Any, source: str) -> None:
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
        raise ConfigError(f"job.config_file = {path!r} does not exist; valid: the path of a TOML file, e.g. "
                          f"train_configs/debug_paro.toml") from None
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


_FLAGS = {"-h": "help", "--help": "help", "--print-config": "print_config", "--estimate": "estimate",
          "--check-config": "check_config"}


def parse_args(argv: list[str], world_size: Optional[int] = None,
               local_world_size: Optional[int] = None) -> tuple[JobConfig, CliArgs]:
    """Defaults, then ``--job.config_file``, then CLI overrides; validated for ``world_size`` (default $WORLD_SIZE)."""
    cli = CliArgs()
    overrides: list[tuple[str, str, Optional[str]]] = []  # (section, key, text or None for a bare flag)
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in _FLAGS:
            setattr(cli, _FLAGS[arg], True)
            continue
        if arg.startswith("--world"):
            text = arg.split("=", 1)[1] if "=" in arg else (argv[i] if i < len(argv) else "")
            i += 0 if "=" in arg else 1
            try:
                cli.world = int(text)
            except ValueError:
                raise ConfigError(f"--world {text!r} must be an integer (the number of ranks to estimate for)") \
                    from None
            continue
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {arg!r}; valid: --section.key value (sections: "
                              f"{', '.join(SECTIONS)}), "
                              "--print-config, --check-config [--world N], --estimate [--world N], --help")
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
            if tp is bool and (nxt is None or nxt.startswith("--")):
                text = "true"  # a bare flag
            elif tp is not bool and (nxt is None or (nxt.startswith("--") and len(nxt) > 2)):
                raise ConfigError(f"--{name} needs a value; valid: {_type_name(tp)}")
            else:
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
        local_world_size = min(8, world_size) if cli.estimate else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    validate(cfg, world_size, local_world_size)
    return cfg, cli


def imply_dataset(cfg: JobConfig, dataset_on_cli: bool) -> None:
    """A ``training.dataset_path`` is never ignored (as in torchtitan): with "embedded" it implies jsonl or text."""
    t = cfg.training
    if not t.dataset_path or t.dataset != "embedded":
        return
    if dataset_on_cli:
        raise ConfigError(f"training.dataset_path = {_show(t.dataset_path)} is read only with training.dataset = "
                          f"\"text\" or \"jsonl\", and the command line also says --training.dataset embedded; "
                          f"valid: drop one of the two (a path alone implies text, or jsonl for .jsonl files)")
    path = t.dataset_path
    if os.path.isdir(path):
        suffixes = {os.path.splitext(f)[1].lower() for _, _, files in os.walk(path) for f in files}
        t.dataset = "jsonl" if suffixes & set(JSONL_SUFFIXES) and not suffixes & set(TEXT_SUFFIXES) else "text"
    else:
        t.dataset = "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "text"


def _is_strategy(text: str) -> bool:
    return isinstance(text, str) and len(text.strip()) == 3 and all(c in "NIG" for c in text.strip().upper())


def validate(cfg: JobConfig, world_size: Optional[int], local_world_size: Optional[int] = None) -> None:
    """Raise ConfigError for well-typed but impossible values (``world_size`` None skips the checks needing it)."""

    def positive(key: str, allow_zero: bool = False) -> None:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{key} = {_show(value)} must be {'>= 0' if allow_zero else '> 0'}")

    def within(key: str, value: Optional[float], top_open: bool = False, unset: str = "") -> None:
        if value is not None and not (0.0 <= value < 1.0 if top_open else 0.0 <= value <= 1.0):
            bound = ")" if top_open else "]"
            raise ConfigError(f"{key} = {value} is out of range; valid: {unset}a number in [0, 1{bound}")

    def invalid(key: str, value: Any, bad: bool, valid: str) -> None:
        if bad:
            raise ConfigError(f"{key} = {value} is invalid; valid: {valid}")

    m, t, p, pf = cfg.model, cfg.training, cfg.parallelism, cfg.peft
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
    invalid("peft.lora_rank", pf.lora_rank, pf.lora_rank < 0, "0 (no LoRA) or a positive rank, e.g. 8")
    if pf.lora_rank and m.name != "hf":
        raise ConfigError("peft.lora_rank > 0 fine-tunes a Hugging Face model; valid: --model.name hf "
                          "--model.hf_path DIR, or peft.lora_rank = 0")
    positive("peft.lora_alpha")
    within("peft.lora_dropout", pf.lora_dropout, top_open=True)
    invalid("model.vocab_size", m.vocab_size, m.vocab_size != -1 and m.vocab_size < 1,
            "-1 (from flavor and tokenizer) or a positive integer")
    for key in ("training.local_batch_size", "training.seq_len", "training.steps", "optimizer.lr", "optimizer.eps"):
        positive(key)
    for key in ("optimizer.weight_decay", "lr_scheduler.warmup_steps", "training.max_consecutive_skips"):
        positive(key, allow_zero=True)
    within("lr_scheduler.min_lr_factor", cfg.lr_scheduler.min_lr_factor)
    within("lr_scheduler.decay_ratio", cfg.lr_scheduler.decay_ratio, unset="unset or ")
    if t.dataset in ("text", "jsonl") and not t.dataset_path:
        raise ConfigError(f"training.dataset_path is required when training.dataset = {_show(t.dataset)}; valid: a "
                          f"file or folder path")
    init = cfg.checkpoint.initial_load_path
    if init and not os.path.isdir(init):
        raise ConfigError(f"checkpoint.initial_load_path = {_show(init)} does not exist; valid: \"\" or a DCP "
                          f"checkpoint folder (e.g. a step-N folder)")
    if t.dataset_path and not os.path.exists(t.dataset_path):
        raise ConfigError(f"training.dataset_path = {_show(t.dataset_path)} does not exist; valid: an existing file "
                          f"or folder")
    per_step = t.local_batch_size * (world_size or 1)
    gbs = t.global_batch_size
    if world_size is not None and gbs != -1 and (gbs < per_step or gbs % per_step):
        examples = ", ".join(str(per_step * k) for k in (1, 2, 4))
        raise ConfigError(f"training.global_batch_size = {gbs} is not a multiple of training.local_batch_size "
                          f"({t.local_batch_size}) x data-parallel ranks ({world_size}) = {per_step}; valid: -1 or a "
                          f"multiple of {per_step} (e.g. {examples})")
    auto = p.paro_strategy.strip().lower() == "auto"
    if auto and p.paro_policy:
        raise ConfigError("parallelism.paro_strategy = \"auto\" cannot be combined with parallelism.paro_policy "
                          "(the advisor picks one strategy for the whole model); valid: an explicit strategy, or "
                          "no paro_policy")
    if not auto and not _is_strategy(p.paro_strategy):
        raise ConfigError(f"parallelism.paro_strategy = {_show(p.paro_strategy)} is not a PaRO strategy; valid: three "
                          "letters of N, I, G for the P, G, OS levels, e.g. IIG, NIG, IGG, ING, GGG (ZeRO-3), "
                          "NNG (ZeRO-1), NNN (DDP)")
    if not auto and p.memory_budget_gib:
        raise ConfigError(f"parallelism.memory_budget_gib = {p.memory_budget_gib} is read only by paro_strategy = "
                          f"\"auto\" (got {_show(p.paro_strategy)}); valid: 0, or set parallelism.paro_strategy = "
                          f"\"auto\"")
    for pattern, strategy in p.paro_policy.items():
        if not _is_strategy(strategy):
            raise ConfigError(f"parallelism.paro_policy.{pattern} = {_show(strategy)} is not a PaRO strategy; valid: "
                              "three letters of N, I, G, e.g. IIG")
    invalid("parallelism.memory_budget_gib", p.memory_budget_gib,
            not p.memory_budget_gib >= 0 or p.memory_budget_gib == float("inf"),
            "0 (no budget: one strategy that fits) or the memory per rank in GiB, e.g. 40")
    invalid("parallelism.paro_flat_below_mb", p.paro_flat_below_mb, p.paro_flat_below_mb < 0,
            "0 (never flat) or a positive size in MiB")
    invalid("parallelism.paro_group_size", p.paro_group_size, p.paro_group_size != -1 and p.paro_group_size < 1,
            "-1 (ranks per node) or a positive divisor of the world size")
    if p.paro_group_size != -1 and world_size is not None and world_size % p.paro_group_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"parallelism.paro_group_size = {p.paro_group_size} does not divide the world size "
                          f"{world_size}; valid: -1 (ranks per node) or one of {divisors}")
    if "hierarchical" in cfg.compile.passes:
        raise ConfigError("compile.passes: 'hierarchical' is no longer a pass: compiled graphs run global collectives "
                          "as PaRO-CC (intra and inter phases) as the eager engine does; drop it, "
                          f"valid: any of {list(GRAPH_PASSES)}")
    unknown = [name for name in cfg.compile.passes if name not in GRAPH_PASSES]
    if unknown:
        raise ConfigError(f"compile.passes has unknown pass(es) {unknown}; valid: any of {list(GRAPH_PASSES)}")
    c = cfg.compile
    invalid("compile.backend", repr(c.backend), c.backend not in ("inductor", "aot_eager", "eager"),
            "inductor, aot_eager, eager")
    invalid("compile.max_prefetch_mb", c.max_prefetch_mb, c.max_prefetch_mb < 0 and c.max_prefetch_mb != -1,
            "-1 (no bound) or >= 0")
    for key, zero in (("metrics.log_freq", False), ("profiling.profile_freq", False), ("profiling.keep_latest_k", True),
                      ("checkpoint.interval", False), ("checkpoint.keep_latest_k", True)):
        positive(key, allow_zero=zero)
    steps = cfg.profiling.traced_micro_steps
    invalid("profiling.traced_micro_steps", steps, steps < 0, "0 (trace every micro-step) or a count >= 1 (the first "
            "ones and the last, which holds the step boundary)")
    invalid("checkpoint.load_step", cfg.checkpoint.load_step, cfg.checkpoint.load_step < -1,
            "-1 (latest) or a saved step")
    positive("comm.init_timeout_seconds")
    positive("comm.train_timeout_seconds")


# ---- what the trainer's builders raise, as one line naming the key ------------------------------------
@contextlib.contextmanager
def config_errors(*kinds: type[BaseException]) -> Iterator[None]:
    """A builder's ``kinds`` of error (a missing file, a model folder's problem) as the one-line ConfigError."""
    try:
        yield
    except kinds as exc:
        raise ConfigError(str(exc)) from None


def check_extras(cfg: JobConfig) -> bool:
    """The optional packages the config needs are installed; returns whether it draws step timelines."""
    if cfg.metrics.enable_tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("metrics.enable_tensorboard = true needs the tensorboard package (pip install tensorboard, "
                          "or this project's [train] extra); valid: false, or install it")
    timeline = cfg.metrics.enable_tensorboard and cfg.profiling.enable_profiling and cfg.profiling.timeline
    if timeline and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("profiling.timeline = true (with metrics.enable_tensorboard and profiling.enable_profiling) "
                          "draws with matplotlib (pip install matplotlib, or this project's [train] extra); valid: "
                          "false, or install it")
    return timeline


def check_one_process(cfg: JobConfig, argv: list[str]) -> None:
    """``python train.py`` without torchrun runs as a world of one rank: a config for more ranks fails its checks
    for one; say so, with the torchrun command for the config's world."""
    try:
        validate(cfg, 1, 1)
    except ConfigError as exc:
        n = _suggest_nproc(cfg)
        cmd = shlex.join(["torchrun", "--standalone", "--nproc-per-node", str(n) if n else "N",
                          sys.argv[0] or "train.py", *argv])
        raise ConfigError(f"train.py was started without torchrun, as a world of 1 rank, and this config is for "
                          f"more: {exc}; run it under torchrun: {cmd}") from None


def _suggest_nproc(cfg: JobConfig) -> Optional[int]:
    """The smallest world this config is valid for, preferring the one without accumulation."""
    t, p = cfg.training, cfg.parallelism
    candidates = [t.global_batch_size // t.local_batch_size] if t.global_batch_size > 0 else []
    if p.paro_group_size > 1:
        candidates += [2 * p.paro_group_size, p.paro_group_size]
    for n in candidates + [4, 2, 8]:
        if n >= 2:
            with contextlib.suppress(ConfigError):
                validate(cfg, n, n)
                return n
    return None


def help_text() -> str:
    """Every key with its type, default and description (``train.py --help``)."""
    import ast
    import inspect

    out = [
        "usage: torchrun --nproc-per-node N train.py --job.config_file FILE.toml [--section.key value ...]",
        "       python train.py --job.config_file FILE.toml --print-config | --check-config [--world N]",
        "       python train.py --job.config_file FILE.toml --estimate --world N",
        "",
        "exit status: 0 trained (or stopped by SIGTERM / SIGINT after saving the step it reached), 2 a configuration",
        "error (one line on stderr), 1 anything else (a failed rank or collective, a checkpoint problem). Under",
        "torchrun the trainer's line comes first and torchrun's own status is 1 whenever a rank failed or torchrun",
        "itself was signalled (its ChildFailedError summary then names rank 0's exit status 2 for a configuration",
        "error). --check-config validates for --world N ranks (default $WORLD_SIZE, else 1) and exits 0 or 2",
        "without training.",
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
            out.append(f"  --{section}.{key} ({_type_name(tp)}; default {_show(default)})  "
                       f"{docs.get(key, '')}".rstrip())
    return "\n".join(out)
