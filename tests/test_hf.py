"""Hugging Face models under ``paro_shard`` on 4 gloo ranks (2 groups of 2), against one process:
transformers' Llama, Qwen2 and GPT-2 (its head tied to the token embedding), and Llama with a
peft LoRA adapter, which generates through its base model. Tiny models made from configs here;
nothing is downloaded."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dist_harness import run_world  # noqa: E402
import hf_cases  # noqa: E402

WORLD = 4
NAMED = ["NNN", "NNG", "NGG", "GGG", "III", "NIG", "NII", "IIG", "IGG", "ING"]
TRAIN = [("llama", "IIG"), ("llama", "GGG"), ("llama", "NIG"), ("llama", "NNN"), ("gpt2", "IIG"), ("gpt2", "GGG"),
         ("qwen2", "IGG"), ("llama-lora", "ING"), ("llama-lora", "IIG")]


@pytest.fixture(scope="module")
def world():
    return run_world(WORLD, "hf_cases:suite", {"train": TRAIN, "generate": NAMED})


@pytest.fixture(scope="module")
def refs():
    return {name: hf_cases.reference(name, WORLD) for name in sorted({n for n, _ in TRAIN})}


@pytest.mark.parametrize("name,strategy", TRAIN, ids=[f"{n}-{s}" for n, s in TRAIN])
def test_training_matches_one_process(world, refs, name, strategy):
    """Losses and grad norms of 3 AdamW steps with accumulation, torch's full state dict after
    them, eval logits and greedy generation: as one process, on every rank."""
    ref = refs[name]
    for rank in world:
        got = rank["train"][(name, strategy)]
        for (loss, norm), (ref_loss, ref_norm) in zip(got["losses"], ref["losses"]):
            assert loss == pytest.approx(ref_loss, rel=1e-6), (loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (norm, ref_norm)
        assert set(got["state"]) == set(ref["state"])
        for key, value in ref["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-5, msg=key)
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=0, atol=1e-5)
        assert torch.equal(got["generated"], ref["generated"])


@pytest.mark.parametrize("strategy", ["ING", "IIG"])
def test_lora_base_weights_have_no_gradient_nor_optimizer_state(world, strategy):
    """Only the adapters train: the gradient buffer and the optimizer's masters and moments hold
    the trainable elements alone (a few percent of the model here)."""
    got = world[0]["train"][("llama-lora", strategy)]
    trainable, mem = got["trainable"], got["memory"]
    d_g = {"N": 1, "I": 2, "G": 4}[strategy[1]]
    assert 0 < trainable < 0.05 * sum(v.numel() for v in got["state"].values())
    assert mem["G"] <= 4 * trainable / d_g + 4 * 64  # fp32 accumulator of the adapters (+ padding)
    assert mem["OS"] <= 12 * trainable / 4 + 12 * 64  # master + 2 AdamW moments, OS = G
    assert got["optimizer_numel"] <= trainable / 4 + 64


@pytest.mark.parametrize("strategy", NAMED)
def test_peft_generate_through_the_base_model(world, strategy):
    """``PeftModel.generate`` calls the inner ``LlamaForCausalLM`` directly: the root's hooks sit
    there, so its parameters are gathered (before: "mixed torch.Tensor and DTensor")."""
    ref = hf_cases.greedy(hf_cases.build("llama-lora").eval())
    for rank in world:
        got = rank["generate"][strategy]
        assert got["entry"] == "LlamaForCausalLM"
        assert torch.equal(got["generated"], ref)


def test_floating_inputs_are_cast_to_the_param_dtype(world):
    """A bf16 model takes fp32 ``inputs_embeds`` (cast as FSDP2's ``cast_forward_inputs``), and
    computes what the bf16 model computes on bf16 inputs; ``cast_forward_inputs=False`` leaves
    them, and torch refuses the mix."""
    model = hf_cases.build("llama").to(torch.bfloat16)
    embeds = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(inputs_embeds=embeds.to(torch.bfloat16)).logits
    got = world[0]["cast"]
    assert got["logits"].dtype == torch.bfloat16
    torch.testing.assert_close(got["logits"], ref, rtol=0, atol=1e-2)
    assert "dtype" in got["uncast"], got["uncast"]


def test_tied_head_keeps_the_hooks_on_the_root(world):
    """GPT-2's lm_head (tied to the embedding inside ``transformer``) runs outside that child,
    so the root's hooks stay on the model itself."""
    assert world[0]["cast"]["gpt2_entry_is_root"]
