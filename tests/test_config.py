"""The trainer's config: TOML + CLI parsing, one-line errors, the shipped configs, the lr schedule."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paro_fsdp.train.config import ConfigError, JobConfig, grad_accum_steps, group_size, to_toml
from paro_fsdp.train.config_parse import load_toml, parse_args

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_cli(tmp_path):
    path = _write(tmp_path, '[training]\nsteps = 7\nseq_len = 64\n[parallelism]\nparo_strategy = "NIG"\n')
    cfg, cli = parse_args(["--job.config_file", path, "--training.steps", "9", "--optimizer.lr=0.5"], world_size=4)
    assert cfg.training.steps == 9 and cfg.training.seq_len == 64  # CLI beats TOML beats default
    assert cfg.parallelism.paro_strategy == "NIG" and cfg.optimizer.lr == 0.5
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size
    assert cfg.job.config_file == path and not cli.print_config


def test_cli_before_config_file_still_wins(tmp_path):
    path = _write(tmp_path, "[training]\nsteps = 7\n")
    cfg, _ = parse_args(["--training.steps", "3", "--job.config_file", path], world_size=1)
    assert cfg.training.steps == 3


def test_bools_lists_tables_and_none():
    cfg, _ = parse_args(
        [
            "--metrics.enable_tensorboard",
            "--checkpoint.enable",
            "false",
            "--training.deterministic=true",
            "--lr_scheduler.decay_ratio",
            "none",
            "--parallelism.paro_policy",
            "output.*=NIG, tok_embeddings.*=NIG",
        ],
        world_size=1,
    )
    assert cfg.metrics.enable_tensorboard is True and cfg.checkpoint.enable is False and cfg.training.deterministic
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.parallelism.paro_policy == {"output.*": "NIG", "tok_embeddings.*": "NIG"}
    cfg, _ = parse_args(["--lr_scheduler.decay_ratio", "0.2", "--lr_scheduler.warmup_steps", "0"], world_size=1)
    assert cfg.lr_scheduler.decay_ratio == 0.2


def test_policy_table_in_toml(tmp_path):
    path = _write(
        tmp_path, '[parallelism]\nparo_strategy = "GGG"\n[parallelism.paro_policy]\n"layers.*.attention.*" = "IIG"\n'
    )
    cfg, _ = parse_args(["--job.config_file", path], world_size=4)
    assert cfg.parallelism.paro_policy == {"layers.*.attention.*": "IIG"}


def test_print_config_round_trips(tmp_path):
    cfg, _ = parse_args(["--training.steps", "5", "--parallelism.paro_policy", "output.*=NNN"], world_size=1)
    path = _write(tmp_path, to_toml(cfg))
    again = JobConfig()
    load_toml(again, path)
    again.job.config_file = cfg.job.config_file
    assert again == cfg


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--training.stepz", "3"], "unknown option --training.stepz; valid keys of [training]: dataset, "),
        (["--trainer.steps", "3"], "no section [trainer]; valid sections: job, model,"),
        (["--training.steps", "many"], "--training.steps 'many' has the wrong type; valid: an integer"),
        (["--training.deterministic", "maybe"], "valid: true or false"),
        (["--optimizer.name", "SGD"], 'optimizer.name = "SGD" is not a valid choice; valid: one of "AdamW", "Adam"'),
        (["--model.flavor", "llama8b"], "valid: debug, llama7b, llama13b, llama65b"),
        (["--parallelism.paro_strategy", "IIX"], "is not a PaRO strategy; valid: three letters of N, I, G"),
        (["--parallelism.paro_policy", "output.*=ZZZ"], 'parallelism.paro_policy.output.* = "ZZZ"'),
        (
            ["--parallelism.paro_group_size", "3"],
            "paro_group_size = 3 does not divide the world size 4; valid: -1 (ranks per node) or one of [1, 2, 4]",
        ),
        (
            ["--parallelism.paro_flat_below_mb", "-1"],
            "paro_flat_below_mb = -1.0 is invalid; valid: 0 (never flat) or a positive size in MiB",
        ),
        (
            ["--training.local_batch_size", "2", "--training.global_batch_size", "12"],
            "global_batch_size = 12 is not a multiple of training.local_batch_size (2) x data-parallel ranks (4) = "
            "8; valid: -1 or a multiple of 8",
        ),
        (
            ["--compile.passes", "bucketing,reoder"],
            "compile.passes has unknown pass(es) ['reoder']; valid: any of ['bucketing', 'reorder']",
        ),
        (["--compile.passes", "bucketing,hierarchical"], "compile.passes: 'hierarchical' is no longer a pass"),
        (["--compile.backend", "tvm"], "compile.backend = 'tvm' is invalid; valid: inductor, aot_eager, eager"),
        (["--activation_checkpoint.mode", "selective"], 'valid: one of "none", "full"'),
        (["--training.dataset", "jsonl"], 'training.dataset_path is required when training.dataset = "jsonl"'),
        (["--training.steps"], "--training.steps needs a value; valid: an integer"),
        (["stray"], "unexpected argument 'stray'"),
        (["--job.config_file", "/nonexistent.toml"], "does not exist; valid: the path of a TOML file"),
        (["--lr_scheduler.min_lr_factor", "2"], "min_lr_factor = 2.0 is out of range; valid: a number in [0, 1]"),
        (
            ["--parallelism.paro_strategy", "auto", "--parallelism.paro_policy", "output.*=GGG"],
            'paro_strategy = "auto" cannot be combined with parallelism.paro_policy',
        ),
        (
            ["--profiling.traced_micro_steps", "-1"],
            "profiling.traced_micro_steps = -1 is invalid; valid: 0 (trace every "
            "micro-step) or a count >= 1 (the first ones and the last",
        ),
    ],
)
def test_errors_name_key_and_choices(argv, needle):
    with pytest.raises(ConfigError) as info:
        parse_args(argv, world_size=4)
    msg = str(info.value)
    assert needle in msg, msg
    assert "\n" not in msg


def test_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[trainig\] in .*valid sections: job"):
        parse_args(["--job.config_file", _write(tmp_path, "[trainig]\nsteps = 1\n")], world_size=1)
    with pytest.raises(ConfigError, match=r"unknown key training.step in .*valid keys of \[training\]"):
        parse_args(["--job.config_file", _write(tmp_path, "[training]\nstep = 1\n")], world_size=1)
    with pytest.raises(ConfigError, match=r'training.steps = "10" has the wrong type; valid: an integer'):
        parse_args(["--job.config_file", _write(tmp_path, '[training]\nsteps = "10"\n')], world_size=1)
    with pytest.raises(ConfigError, match=r"metrics.enable_tensorboard = 1 has the wrong type; valid: true or false"):
        parse_args(["--job.config_file", _write(tmp_path, "[metrics]\nenable_tensorboard = 1\n")], world_size=1)
    with pytest.raises(ConfigError, match="is not valid TOML"):
        parse_args(["--job.config_file", _write(tmp_path, "[training\n")], world_size=1)


def test_activation_checkpoint_combinations():
    parse_args(["--activation_checkpoint.mode", "full"], world_size=4)  # with re-sharding after forward
    parse_args(
        ["--activation_checkpoint.mode", "full", "--parallelism.paro_reshard_after_forward", "false"], world_size=4
    )
    parse_args(["--activation_checkpoint.mode", "full", "--parallelism.paro_strategy", "NNG"], world_size=4)


def test_world_dependent_values():
    cfg, _ = parse_args(["--training.local_batch_size", "2", "--training.global_batch_size", "32"], world_size=4)
    assert grad_accum_steps(cfg, 4) == 4
    cfg, _ = parse_args([], world_size=4)
    assert grad_accum_steps(cfg, 4) == 1
    assert group_size(cfg, 16, local_world_size=8) == 8  # -1: ranks per node
    assert group_size(cfg, 4, local_world_size=3) == 4  # a node size that does not divide: one group
    parse_args(["--parallelism.paro_group_size", "3"], world_size=None)  # unknown world: checked later


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_parse(path):
    if path.name.startswith("debug"):
        folder = ["--model.hf_path", "DIR"] if path.name == "debug_hf.toml" else []  # its template asks for one
        cfg, _ = parse_args(["--job.config_file", str(path), *folder], world_size=4, local_world_size=4)
        assert group_size(cfg, 4) == 2 and cfg.training.mixed_precision_param == "float32"
        return
    for world in (32, 64, 128):  # realistic batch sizes divide for 32..128 GPUs (8 per node)
        cfg, _ = parse_args(["--job.config_file", str(path), "--print-config"], world_size=world, local_world_size=8)
        assert group_size(cfg, world, 8) == 8 and grad_accum_steps(cfg, world) >= 1
        parse_args(["--job.config_file", str(path)], world_size=world, local_world_size=8)
    assert cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.parallelism.paro_strategy == ("GGG" if "zero3" in path.name else "IIG")


def test_expected_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {
        "debug_paro.toml",
        "llama7b_paro.toml",
        "llama13b_paro.toml",
        "llama65b_paro.toml",
        "llama7b_zero3.toml",
    } <= names


def test_train_py_exits_2_with_one_line():
    env = dict(os.environ, WORLD_SIZE="4")
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "train_configs/debug_paro.toml",
            "--training.global_batch_size",
            "30",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: training.global_batch_size = 30"), proc.stderr
    proc = subprocess.run(
        [sys.executable, "train.py", "--job.config_file", "train_configs/debug_paro.toml", "--print-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and 'paro_strategy = "IIG"' in proc.stdout


def test_train_py_estimate():
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "train_configs/debug_paro.toml",
            "--estimate",
            "--world",
            "4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "4 ranks = 2 groups x 2" in proc.stdout
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("IIG ", "GGG "))]
    assert len(rows) == 2, proc.stdout  # the config's strategy and ZeRO-3 beside it


# ---- the lr schedule (torchtitan semantics) ----------------------------------------------------
def test_lr_schedule():
    import torch

    from paro_fsdp.train.config import LRScheduler
    from paro_fsdp.train.lr import build_lr_scheduler, lr_factor

    def curve(**kw):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = build_lr_scheduler(opt, LRScheduler(**kw), 10)
        out = []
        for _ in range(10):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    lin = curve(warmup_steps=2, decay_type="linear", min_lr_factor=0.0)
    assert lin[:2] == pytest.approx([1 / 3, 2 / 3])
    assert lin[2] == pytest.approx(1 - 1 / 9) and lin[-1] == pytest.approx(1 / 9)
    assert all(a > b for a, b in zip(lin[2:], lin[3:]))
    cos = curve(warmup_steps=0, decay_type="cosine", min_lr_factor=0.1)
    assert min(cos) >= 0.1 and cos[0] < 1.0 and cos == sorted(cos, reverse=True)
    const = curve(warmup_steps=3, decay_type="constant")
    assert const[3:] == [1.0] * 7
    wsd = curve(warmup_steps=2, decay_ratio=0.5, decay_type="linear")
    assert wsd[2:5] == [1.0, 1.0, 1.0] and wsd[5] < 1.0
    assert lr_factor(9, 2, 0, 8, "linear", 0.25) == pytest.approx(0.25 + 0.75 / 9)  # the last step
    assert lr_factor(100, 2, 0, 8, "linear", 0.25) == pytest.approx(0.25)  # past the end: the floor


def test_inter_dtype_is_the_engines_wire():
    from paro_fsdp.train.parallelize import mixed_precision

    assert mixed_precision(parse_args([], world_size=4)[0]).inter_dtype is None
    cfg, _ = parse_args(["--parallelism.inter_dtype", "int8"], world_size=4)
    assert mixed_precision(cfg).inter_dtype == "int8"
    with pytest.raises(ConfigError, match='inter_dtype = .int2. is not a valid choice; valid: one of "none", "int8", '
                                          '"int4"'):
        parse_args(["--parallelism.inter_dtype", "int2"], world_size=4)
