"""Accelerate, the HF ``Trainer`` and TRL run PaRO by one switch (``use_paro``), on 4 gloo ranks:
a tiny ``LlamaForCausalLM`` (fp32) fine-tuned through accelerate's FSDP2 plugin, once sharded by
torch's ``fully_shard`` and once by PaRO (IIG on 2 groups of 2: from ``group_size``, or from a
``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``), with the same numbers: through
``Accelerator`` (``accumulate``, ``clip_grad_norm_``, ``save_state`` / ``load_state`` resume,
``get_state_dict`` + ``save_pretrained`` export), the ``Trainer``, LoRA through peft (then
``generate``) and TRL's ``SFTTrainer``. accelerate runs FSDP on CPU through the harness's
``accelerate_cpu`` shim. One world for the module, every case inside it; TRL's cases in a second
one (only the TRL test starts it)."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from dist_harness import run_world  # noqa: E402

STEPS, MORE, A, LR, MAX_NORM, SEQ = 3, 2, 2, 1e-2, 1.0, 16
PROMPT = torch.tensor([[3, 17, 29, 101, 5, 64, 200, 7, 12, 250]])
LORA = {"target_modules": ["q_proj", "v_proj"]}
ACC_CASES = [("torch", False), ("paro", False), ("torch", True), ("paro", True)]  # (impl, ParallelismConfig)


# ---- inside the ranks -----------------------------------------------------------------------------
def _switch(impl: str, strategy: str = "IIG", **kw: Any) -> None:
    from paro_fsdp.integrations.accelerate import disable_paro, use_paro

    if impl == "paro":
        use_paro(strategy, **{"group_size": 2, **kw})
    else:
        disable_paro()


def _plugin() -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                          state_dict_type="SHARDED_STATE_DICT")


def _accelerator(pc: bool) -> Any:
    from accelerate import ParallelismConfig
    from accelerate_cpu import fresh_accelerator

    extra = {"parallelism_config": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)} if pc else {}
    return fresh_accelerator(fsdp_plugin=_plugin(), gradient_accumulation_steps=A, **extra)


def _prepared(acc: Any, lora: bool = False) -> tuple[Any, Any, Any]:
    import hf_models

    model = hf_models.make("llama", lora=LORA if lora else None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    return acc.prepare(model, opt, sched)


def _windows(seed: int, n: int, rolls: int = 0) -> torch.Tensor:
    """``n`` windows of one repeating pattern (``seed``'s: something to learn in a few steps),
    rolled at random (``rolls``' draws)."""
    pattern = torch.randint(0, 256, (SEQ,), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(rolls)
    return torch.stack([pattern.roll(int(torch.randint(0, SEQ, (1,), generator=g))) for _ in range(n)])


def _rows(n: int) -> torch.Tensor:
    """A Trainer's dataset: ``n`` rows, each of its own pattern (every rank and micro-batch sees
    different tokens, so a gradient dropped or counted twice shows in the grad norm)."""
    return torch.cat([_windows(100 + i, 1, i) for i in range(n)])


def _ids(step: int, micro: int, n: int = 2) -> torch.Tensor:
    """This rank's pattern, the rolls of (rank, step, micro)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    return _windows(rank, n, 1000 * rank + 10 * step + micro)


def _train(acc: Any, model: Any, opt: Any, sched: Any, steps: range) -> list[tuple[float, float]]:
    """The accelerate way: ``accumulate`` over A micro-batches, the clip on the syncing one."""
    import torch.distributed as dist

    out = []
    for step in steps:
        total, norm = torch.zeros(()), None
        for micro in range(A):
            with acc.accumulate(model):
                ids = _ids(step, micro)
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
                opt.step()
                sched.step()
                opt.zero_grad()
            total += loss.detach() / A
        dist.all_reduce(total)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        out.append(((total / dist.get_world_size()).item(), float(norm)))
    return out


def _is_paro(model: Any) -> bool:
    from paro_fsdp import ParoModule

    return isinstance(model, ParoModule)


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROMPT).logits.detach().clone()


def accelerator_case(impl: str, pc: bool, tmp: str) -> dict[str, Any]:
    """Train, ``save_state``, train on; a fresh Accelerator and model ``load_state`` and retrace
    the same steps; then ``get_state_dict`` + ``save_pretrained``, reloaded by ``from_pretrained``."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    _switch(impl)
    where = f"{tmp}/{impl}-{'pc' if pc else 'group'}"
    acc = _accelerator(pc)
    model, opt, sched = _prepared(acc)
    out: dict[str, Any] = {"losses": _train(acc, model, opt, sched, range(STEPS)),
                           "paro": _is_paro(model)}
    acc.save_state(f"{where}/state")
    out["after"] = _train(acc, model, opt, sched, range(STEPS, STEPS + MORE))

    acc = _accelerator(pc)
    model, opt, sched = _prepared(acc)
    acc.load_state(f"{where}/state")
    out["resumed"] = _train(acc, model, opt, sched, range(STEPS, STEPS + MORE))
    state = acc.get_state_dict(model)
    acc.unwrap_model(model).save_pretrained(f"{where}/hf", state_dict=state, is_main_process=acc.is_main_process,
                                            save_function=acc.save)
    acc.wait_for_everyone()
    out["logits"] = _logits(model)
    if dist.get_rank() == 0:
        back = LlamaForCausalLM.from_pretrained(f"{where}/hf", dtype=torch.float32)
        out["export_diff"] = (_logits(back) - out["logits"]).abs().max().item()
    return out


def auto_case() -> list[tuple[float, float]]:
    """``use_paro("auto")``: planned on the whole model at accelerate's root call."""
    _switch("paro", "auto", cluster="h100_ndr")
    acc = _accelerator(False)
    model, opt, sched = _prepared(acc)
    return _train(acc, model, opt, sched, range(2))


def trainer_case(impl: str, tmp: str) -> dict[str, Any]:
    """The HF ``Trainer`` with ``fsdp="full_shard"``, ``fsdp_config={"version": 2}``."""
    import hf_models
    from accelerate_cpu import cpu_trainer
    from transformers import Trainer, TrainingArguments

    _switch(impl)
    args = TrainingArguments(
        output_dir=f"{tmp}/trainer-{impl}", use_cpu=True, per_device_train_batch_size=2,
        gradient_accumulation_steps=A, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
        fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    data = [{"input_ids": ids, "labels": ids} for ids in _rows(4 * 2 * A * STEPS)]
    trainer = cpu_trainer(Trainer)(model=hf_models.make("llama"), args=args, train_dataset=data)
    trainer.train()
    return {"log": [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h],
            "paro": _is_paro(trainer.model)}


def lora_case(impl: str) -> dict[str, Any]:
    """LoRA (peft) through accelerate's FSDP2, then ``generate`` on the ``PeftModel``."""
    _switch(impl, "ING")
    acc = _accelerator(False)
    model, opt, sched = _prepared(acc, lora=True)
    out: dict[str, Any] = {"losses": _train(acc, model, opt, sched, range(2))}
    with torch.no_grad():
        # generate calls the base model's forward, not the PeftModel's: torch's FSDP2 has its root
        # hooks on the PeftModel and meets the root's own parameters (the final norm) still sharded,
        # so it needs one forward through the PeftModel first (the root then stays unsharded).
        # PaRO's root hooks are on the base model (every call passes through it): generate as is.
        if impl == "torch":
            model(input_ids=PROMPT)
        out["tokens"] = model.generate(input_ids=PROMPT, max_new_tokens=6, do_sample=False).tolist()
    return out


def sft_case(impl: str, tmp: str) -> dict[str, Any]:
    """TRL's ``SFTTrainer`` on pre-tokenised rows, the byte tokenizer as its processing class."""
    import hf_models
    import torch.distributed as dist
    from accelerate_cpu import cpu_trainer
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    _switch(impl)
    # one file per rank: ranks writing one path at once let a rank read it half-written ("EOF while
    # parsing"); that rank then left the world early and the others lost their peer ("Connection closed")
    path = hf_models.byte_tokenizer_json(f"{tmp}/tokenizer-{impl}-{dist.get_rank()}.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    rows = _rows(4 * 2 * A * 2)
    # bf16=False: SFTConfig defaults to bf16, and accelerate's FSDP2 policy then reduces gradients in
    # bf16, where torch's reduce-scatter and PaRO's collectives (another summation order) differ by an
    # ulp; fp32, as the Trainer case (bf16 with reduce_dtype=float32 also matches bit for bit)
    args = SFTConfig(output_dir=f"{tmp}/sft-{impl}", use_cpu=True, bf16=False, per_device_train_batch_size=2,
                     gradient_accumulation_steps=A, max_steps=2, learning_rate=LR, lr_scheduler_type="constant",
                     max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                     disable_tqdm=True, fsdp="full_shard",
                     fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    trainer = cpu_trainer(SFTTrainer)(model=hf_models.make("llama"), args=args, processing_class=tok,
                                      train_dataset=Dataset.from_dict({"input_ids": rows.tolist()}))
    trainer.train()
    return {"log": [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h],
            "paro": _is_paro(trainer.model)}


def bad_input_case() -> dict[str, str]:
    """Each refusal, as the one line a user reads."""
    from paro_fsdp.integrations.accelerate import use_paro

    out = {}
    for name, call in (("strategy", lambda: use_paro("IXG")), ("group", lambda: use_paro(group_size=0)),
                       ("budget", lambda: use_paro("IIG", memory_budget=2**30))):
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    _switch("paro", group_size=3)  # 3 does not divide 4: found when accelerate shards
    acc = _accelerator(False)
    try:
        _prepared(acc)
        out["divide"] = "no error"
    except ValueError as e:
        out["divide"] = str(e)
    return out


def world4(payload: dict[str, Any]) -> dict[str, Any]:
    import time

    tmp, out, took = payload["tmp"], {}, {}
    cases = {f"acc/{impl}/{pc}": (accelerator_case, impl, pc, tmp) for impl, pc in ACC_CASES}
    cases.update({"auto": (auto_case,), "lora/torch": (lora_case, "torch"), "lora/paro": (lora_case, "paro"),
                  "trainer/torch": (trainer_case, "torch", tmp), "trainer/paro": (trainer_case, "paro", tmp),
                  "bad": (bad_input_case,)})
    if payload.get("trl"):  # their own world
        cases = {"sft/torch": (sft_case, "torch", tmp), "sft/paro": (sft_case, "paro", tmp)}
    for name, (fn, *args) in cases.items():
        if payload.get("only") and name not in payload["only"]:
            continue
        t0 = time.perf_counter()
        try:
            out[name] = fn(*args)
        except Exception as e:  # one case's failure is reported by its test, the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        took[name] = round(time.perf_counter() - t0, 1)
    _switch("torch")
    out["took"] = took
    return out


# ---- the world, once per module -------------------------------------------------------------------
def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("accelerate"))
    return run_world(4, world4, {"tmp": tmp, "only": _only()})[0]


@pytest.fixture(scope="module")
def trl_world(tmp_path_factory) -> dict[str, Any]:
    if not (_has("trl") and _has("datasets")):
        pytest.skip("trl (and datasets) not installed")
    tmp = str(tmp_path_factory.mktemp("accelerate_trl"))
    return run_world(4, world4, {"tmp": tmp, "trl": True, "only": _only()})[0]


def _only() -> list[str]:
    """``PARO_TEST_ACCELERATE_ONLY=acc/paro/False,...``: run those cases only (while debugging one)."""
    return [c for c in os.environ.get("PARO_TEST_ACCELERATE_ONLY", "").split(",") if c]


def _ok(world: dict[str, Any], name: str) -> Any:
    got = world.get(name)
    if got is None:
        pytest.skip(f"{name} not run")
    assert not (isinstance(got, dict) and "error" in got), f"{name}: {got['error']}"
    return got


def _same(got: list[tuple[float, float]], ref: list[tuple[float, float]], rel: float = 1e-5) -> None:
    assert len(got) == len(ref) > 0
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert loss == pytest.approx(ref_loss, rel=rel), (got, ref)
        assert norm == pytest.approx(ref_norm, rel=rel), (got, ref)


# ---- checks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pc", [False, True], ids=["group_size", "parallelism_config"])
def test_accelerator_paro_matches_fsdp2(world, pc):
    ref, got = _ok(world, f"acc/torch/{pc}"), _ok(world, f"acc/paro/{pc}")
    assert got["paro"] and not ref["paro"]  # the switch sharded with PaRO, and only when on
    _same(got["losses"] + got["after"], ref["losses"] + ref["after"])
    assert ref["losses"][-1][0] < ref["losses"][0][0]
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("impl,pc", ACC_CASES, ids=[f"{i}-{'pc' if p else 'group'}" for i, p in ACC_CASES])
def test_accelerator_load_state_retraces_and_export_reloads(world, impl, pc):
    got = _ok(world, f"acc/{impl}/{pc}")
    _same(got["resumed"], got["after"], rel=1e-6)
    assert got["export_diff"] <= 1e-5


def test_auto_strategy_matches_fsdp2(world):
    _same(_ok(world, "auto"), _ok(world, "acc/torch/False")["losses"][:2])


def test_trainer_paro_matches_fsdp2(world):
    ref, got = _ok(world, "trainer/torch"), _ok(world, "trainer/paro")
    assert got["paro"] and not ref["paro"]
    assert len(ref["log"]) == STEPS
    _same(got["log"], ref["log"])


def test_lora_trains_and_generates_as_fsdp2(world):
    ref, got = _ok(world, "lora/torch"), _ok(world, "lora/paro")
    _same(got["losses"], ref["losses"])
    assert got["tokens"] == ref["tokens"] and len(got["tokens"][0]) == PROMPT.shape[1] + 6


def _sft(world: dict[str, Any]) -> tuple[Any, Any]:
    return _ok(world, "sft/torch"), _ok(world, "sft/paro")


def test_trl_sft_trainer_paro_matches_fsdp2(trl_world):
    ref, got = _sft(trl_world)
    assert got["paro"] and not ref["paro"]
    _same(got["log"], ref["log"])


@pytest.mark.parametrize("case,needles", [
    ("strategy", ["unknown PaRO strategy 'IXG'", "IIG"]),
    ("group", ["group_size must be a positive integer"]),
    ("budget", ["read only by strategy=\"auto\""]),
    ("divide", ["group_size 3 does not divide the world size 4", "[1, 2, 4]"]),
])
def test_bad_input_is_one_line_naming_the_fix(world, case, needles):
    line = _ok(world, "bad")[case]
    assert "\n" not in line, line
    for needle in needles:
        assert needle in line, line
