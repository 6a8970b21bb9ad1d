"""Everything a user types, wrong, through ``train.main`` as ``python train.py ...`` runs it (a
world of one): one line on stderr that names the key or file and what would be valid, and an
exit status (2: configuration, 1: a checkpoint). The config parser's own table is in
test_config.py; this one covers what only shows once the trainer starts."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TINY = ["--model.flavor", "debug", "--training.seq_len", "16", "--training.local_batch_size", "1",
        "--training.mixed_precision_param", "float32", "--metrics.enable_tensorboard", "false",
        "--profiling.enable_profiling", "false", "--comm.backend", "gloo", "--training.steps", "1"]


@pytest.fixture
def fresh_env():
    """``train.main`` fills RANK/WORLD_SIZE/MASTER_* for a world of one; each case gets its own."""
    saved = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _main(argv: list[str], capsys) -> tuple[int, list[str]]:
    import train

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    code = train.main(TINY + argv)
    err = capsys.readouterr().err
    return code, [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith("  ")]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad_input")
    (root / "empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "blank.txt").write_text("   \n")
    (root / "tiny.txt").write_text("hi")
    (root / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (root / "config.toml").write_text("[training]\nstep = 10\n")
    return {k: str(root / k) for k in ("empty", "notes", "tiny.txt", "broken.jsonl", "config.toml")} | {
        "root": str(root)
    }


def test_every_bad_input_is_one_line(files, capsys, fresh_env):
    root = files["root"]
    # a checkpoint to mismatch against: one step of the 258-id byte tokenizer model
    code, lines = _main(["--job.dump_folder", f"{root}/run", "--checkpoint.enable"], capsys)
    assert code == 0, lines
    capsys.readouterr()
    cases = [  # (what the user typed, exit status, what the line must name)
        (["--job.config_file", f"{root}/nope.toml"], 2, ["nope.toml", "does not exist", "valid"]),
        (["--job.config_file", files["config.toml"]], 2, ["unknown key training.step", "config.toml", "valid keys"]),
        (["--training.stpes", "3"], 2, ["--training.stpes", "valid keys of [training]"]),
        (["--parallelism.paro_strategy", "IXG"], 2, ["IXG", "valid: three letters of N, I, G"]),
        (["--parallelism.paro_group_size", "2"], 2, ["paro_group_size = 2 does not divide the world size 1", "valid"]),
        (["--training.dataset", "text", "--training.dataset_path", f"{root}/missing"], 2,
         ["training.dataset_path", "missing", "does not exist", "valid"]),
        (["--training.dataset", "text", "--training.dataset_path", files["empty"]], 2,
         ["training.dataset_path", "empty", "holds no .txt", "valid"]),
        (["--training.dataset", "text", "--training.dataset_path", files["notes"]], 2,
         ["training.dataset", "no non-empty documents", "valid"]),
        (["--training.dataset", "text", "--training.dataset_path", files["tiny.txt"]], 2,
         ["fewer than one window of training.seq_len + 1", "valid: a smaller training.seq_len"]),
        (["--training.dataset", "jsonl", "--training.dataset_path", files["broken.jsonl"]], 2,
         ["broken.jsonl:2", "not valid JSON"]),
        (["--model.tokenizer", f"{root}/tokenizer.json"], 2, ["tokenizer.json"]),
        (["--job.dump_folder", f"{root}/run", "--checkpoint.enable", "--model.vocab_size", "300"], 1,
         ["does not fit this model", "its vocabulary has 258 rows, this model 300", "model.tokenizer"]),
        (["--job.dump_folder", f"{root}/run", "--checkpoint.enable", "--checkpoint.load_step", "7"], 2,
         ["checkpoint.load_step = 7", "valid: -1 or one of [1]"]),
        (["--checkpoint.initial_load_path", f"{root}/weights"], 2,
         ["checkpoint.initial_load_path", "weights", "does not exist", "valid"]),
        (["--comm.backend", "nccl"], 2, ['comm.backend = "nccl" needs CUDA GPUs', "valid: auto, gloo"]),
        (["--training.on_nonfinite", "ignore"], 2, ["training.on_nonfinite", 'valid: one of "skip", "stop"']),
    ]
    for argv, status, needles in cases:
        code, lines = _main(argv, capsys)
        assert code == status and len(lines) == 1 and lines[0].startswith("train.py: error: "), (argv, code, lines)
        for needle in needles:
            assert needle in lines[0], (argv, needle, lines[0])


@pytest.mark.parametrize("kwargs, names", [
    (dict(param_dtype="bfloat16", accumulate_dtype="float16"), "accumulate_dtype=torch.float16"),
    (dict(param_dtype="float16", accumulate_dtype="float16"), "accumulate_dtype=torch.float16"),
])
def test_float16_gradient_sums_are_refused_naming_bf16(kwargs, names):
    """The G accumulator sums undivided micro-step gradients; in fp16 that overflows, so an fp16
    accumulate dtype is one line that names the dtype to use instead (an fp16 reduce is pre-divided
    as FSDP2's: tests/test_fp16.py)."""
    import torch

    from paro_fsdp import MixedPrecision

    with pytest.raises(ValueError) as err:
        MixedPrecision(**{k: getattr(torch, v) for k, v in kwargs.items()})
    msg = str(err.value)
    assert "\n" not in msg and names in msg and ("torch.bfloat16" in msg or "torch.float32" in msg), msg


def test_float16_parameters_with_a_wider_reduce_dtype_are_accepted():
    import torch

    from paro_fsdp import MixedPrecision

    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    assert mp.grad_dtype == torch.float32 and mp.acc_dtype == torch.float32
