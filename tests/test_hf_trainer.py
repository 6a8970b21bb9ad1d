"""The trainer fine-tunes Hugging Face model folders (``--model.name hf``) on 4 gloo ranks (2
groups of 2): tiny Llama (sharded safetensors), Qwen2 and GPT-2 (tied head) folders made with
``save_pretrained`` here; the first loss is the loaded model's, the export
(``checkpoint.last_save_in_hf``) reloads with ``from_pretrained`` to the trained logits; LoRA
(``[peft]``) exports an adapter ``PeftModel.from_pretrained`` loads and resumes exactly; the
trainer's own Llama exports as a ``LlamaForCausalLM``; a bad folder or setting is one line."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dist_harness import run_world  # noqa: E402
import hf_models  # noqa: E402

STEPS = 3
BASE = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.global_batch_size", "16",
        "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32",
        "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false", "--comm.backend", "gloo",
        "--parallelism.paro_group_size", "2", "--training.steps", str(STEPS)]
PROMPT = torch.tensor([[3, 17, 29, 101, 5, 64, 200, 7, 12, 250]])
RUNS = {  # name -> (folder kind, arguments)
    "llama": ("llama-sharded", ["--parallelism.paro_strategy", "IIG", "--checkpoint.last_save_in_hf"]),
    "qwen2": ("qwen2", ["--parallelism.paro_strategy", "GGG", "--activation_checkpoint.mode", "full",
                        "--parallelism.paro_policy", "*.embed_tokens.*=NIG", "--checkpoint.last_save_in_hf"]),
    "gpt2": ("gpt2", ["--parallelism.paro_strategy", "NIG", "--checkpoint.last_save_in_hf"]),
    "lora": ("llama", ["--parallelism.paro_strategy", "ING", "--peft.lora_rank", "4", "--peft.lora_alpha", "8",
                       "--checkpoint.last_save_in_hf", "--checkpoint.enable", "--checkpoint.interval", "2",
                       "--training.steps", "4"]),
}


# ---- run inside the ranks -----------------------------------------------------------------------
def _run(argv: list[str], probe: bool = True) -> dict[str, Any]:
    from paro_fsdp.train.config_parse import parse_args
    from train import Trainer

    cfg, _ = parse_args(BASE + argv)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        trainer = Trainer(cfg)
        out: dict[str, Any] = {}
        if probe:  # the loaded model's loss on a fixed window, before any step
            with torch.no_grad():
                out["probe"] = trainer.forward_loss(trainer.model, PROMPT).item()
        out["losses"] = trainer.train()
        trainer.close()
    with torch.no_grad():
        out["logits"] = (trainer.model(input_ids=PROMPT).logits if cfg.model.name == "hf"
                         else trainer.model(PROMPT[:, :-1], PROMPT[:, 1:]).logits).detach()
    out["log"] = log.getvalue()
    return out


def _main(argv: list[str]) -> tuple[int, str]:
    import train

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train.main(BASE + argv)
    return code, err.getvalue()


def world4(payload: dict[str, Any]) -> dict[str, Any]:
    tmp, folders = payload["tmp"], payload["folders"]
    out: dict[str, Any] = {}
    for name, (kind, argv) in RUNS.items():
        out[name] = _run(["--model.name", "hf", "--model.hf_path", folders[kind], "--job.dump_folder", f"{tmp}/{name}"]
                         + argv)
    # the LoRA run again from its step-2 checkpoint: the base weights from the folder, the adapters from it
    out["lora/resumed"] = _run(["--model.name", "hf", "--model.hf_path", folders["llama"], "--job.dump_folder",
                                f"{tmp}/lora", "--checkpoint.load_step", "2"] + RUNS["lora"][1], probe=False)
    # the trainer's own Llama, exported under Hugging Face names
    out["own"] = _run(["--model.name", "llama", "--model.flavor", "debug", "--model.tokenizer", "byte",
                       "--parallelism.paro_strategy", "IIG", "--job.dump_folder", f"{tmp}/own",
                       "--checkpoint.last_save_in_hf"], probe=False)
    hf = ["--model.name", "hf", "--job.dump_folder", f"{tmp}/bad"]
    out["errors"] = {
        "no_config": _main(hf + ["--model.hf_path", folders["empty"]]),
        "unknown_arch": _main(hf + ["--model.hf_path", folders["unknown"]]),
        "vocab": _main(hf + ["--model.hf_path", folders["small_vocab"]]),
        "targets": _main(hf + ["--model.hf_path", folders["llama"], "--peft.lora_rank", "4",
                               "--peft.target_modules", "query,value"]),
    }
    return out


def world4_compiled(payload: dict[str, Any]) -> dict[str, Any]:
    """Per-block compile (AOTAutograd graphs, no inductor codegen) of a Hugging Face model's
    decoder layers, with activation checkpointing, against the same run eager."""
    tmp, folder = payload["tmp"], payload["folders"]["qwen2"]
    argv = ["--model.name", "hf", "--model.hf_path", folder, "--parallelism.paro_strategy", "IIG",
            "--activation_checkpoint.mode", "full"]
    return {"eager": _run(argv + ["--job.dump_folder", f"{tmp}/eager"], probe=False)["losses"],
            "compiled": _run(argv + ["--job.dump_folder", f"{tmp}/compiled", "--compile.enable", "--compile.backend",
                                     "aot_eager"], probe=False)["losses"]}


# ---- the world, once per module -----------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_folders")
    out = {kind: hf_models.save_folder(kind, str(root / kind)) for kind in hf_models.KINDS}
    out["llama-sharded"] = hf_models.save_folder("llama", str(root / "llama-sharded"), max_shard_size="30KB")
    (root / "empty").mkdir()
    out["empty"] = str(root / "empty")
    unknown = root / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "notamodel", "hidden_size": 8}))
    out["unknown"] = str(unknown)
    small = hf_models.save_folder("llama", str(root / "small_vocab"), vocab=64, tokenizer=False)
    hf_models.byte_tokenizer_json(os.path.join(small, "tokenizer.json"))  # 258 ids, 64 embedding rows
    out["small_vocab"] = small
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf_trainer"))


@pytest.fixture(scope="module")
def world(folders, tmp) -> dict[str, Any]:
    return run_world(4, "test_hf_trainer:world4", {"tmp": tmp, "folders": folders})[0]


def _loss(model: torch.nn.Module, window: torch.Tensor) -> float:
    from paro_fsdp.train.hf_model import loss

    with torch.no_grad():
        return loss(model, window).item()


# ---- checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_trains_a_folder_and_exports_what_it_trained(world, folders, tmp, name):
    """Loaded exactly (the first loss is the folder's model's), trains, and the export opens in
    transformers with the trained model's logits."""
    from transformers import AutoModelForCausalLM

    got = world[name]
    loaded = AutoModelForCausalLM.from_pretrained(folders[RUNS[name][0]], dtype=torch.float32)
    assert got["probe"] == pytest.approx(_loss(loaded, PROMPT), rel=1e-6)
    losses = got["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    export = f"{tmp}/{name}/checkpoint/step-{STEPS}-hf"
    assert f"Hugging Face export (checkpoint.last_save_in_hf): {export}" in got["log"]
    files = sorted(os.listdir(export))
    assert "config.json" in files and "model.safetensors.index.json" in files and "tokenizer.json" in files
    assert not any(f in ("sharded", "paro_manifest.json") for f in files)
    back = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=PROMPT).logits, got["logits"], rtol=0, atol=1e-5)


def test_lora_trains_adapters_only_and_exports_an_adapter(world, folders, tmp):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    got = world["lora"]
    header = next(line for line in got["log"].splitlines() if line.startswith("[paro] model hf"))
    assert "LoRA rank 4" in header and "(100.00%" not in header  # the start-up line says how many weights train
    base = AutoModelForCausalLM.from_pretrained(folders["llama"], dtype=torch.float32)
    assert got["probe"] == pytest.approx(_loss(base, PROMPT), rel=1e-6)  # lora_B = 0: the base model's loss
    adapter = f"{tmp}/lora/checkpoint/step-4-hf-adapter"
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    tuned = PeftModel.from_pretrained(base, adapter)
    with torch.no_grad():
        torch.testing.assert_close(tuned(input_ids=PROMPT).logits, got["logits"], rtol=0, atol=1e-5)


def test_lora_resumes_exactly(world):
    full, resumed = world["lora"]["losses"], world["lora/resumed"]["losses"]
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7)


def test_own_llama_exports_as_a_transformers_llama(world, tmp):
    """Hugging Face names, and q / k rows in its RoPE layout (halves, not interleaved pairs):
    transformers' LlamaForCausalLM computes the trained model's logits."""
    from transformers import LlamaForCausalLM

    back = LlamaForCausalLM.from_pretrained(f"{tmp}/own/checkpoint/step-{STEPS}-hf", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=PROMPT[:, :-1]).logits, world["own"]["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case,needles", [
    ("no_config", ["has no config.json", "save_pretrained"]),
    ("unknown_arch", ["'notamodel' is not an architecture transformers", "pip install -U transformers"]),
    ("vocab", ["has 258 ids, more than the 64 rows", "model.tokenizer"]),
    ("targets", ["peft.target_modules = ['query', 'value'] matches no module", "q_proj"]),
])
def test_bad_folder_or_setting_is_one_line(world, case, needles):
    code, err = world["errors"][case]
    lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith("  ")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
def test_compiled_blocks_match_eager(folders, tmp_path):
    got = run_world(4, "test_hf_trainer:world4_compiled", {"tmp": str(tmp_path), "folders": folders})[0]
    assert sorted(got["compiled"]) == list(range(1, STEPS + 1))
    for step, loss in got["eager"].items():
        assert got["compiled"][step] == pytest.approx(loss, rel=1e-5), step
