"""Hugging Face models under ``paro_shard`` on 4 gloo ranks (2 groups of 2), against one process:
transformers' Llama, Qwen2 and GPT-2 (its head tied to the token embedding), and Llama with a
peft LoRA adapter, which generates through its base model. Tiny models made from configs here;
nothing is downloaded."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dist_harness import run_world  # noqa: E402
import hf_models  # noqa: E402

WORLD = 4
NAMED = ["NNN", "NNG", "NGG", "GGG", "III", "NIG", "NII", "IIG", "IGG", "ING"]
TRAIN = [("llama", "IIG"), ("llama", "GGG"), ("llama", "NIG"), ("llama", "NNN"), ("gpt2", "IIG"), ("gpt2", "GGG"),
         ("qwen2", "IGG"), ("llama-lora", "ING"), ("llama-lora", "IIG")]
B, T, STEPS, ACCUM, LR, MAX_NORM = 2, 12, 3, 2, 1e-3, 1.0
PROMPT = torch.tensor([[3, 17, 29, 101, 5, 64]])
NEW_TOKENS = 6
LORA = {"target_modules": ["q_proj", "v_proj"]}
CHECKPOINTING = [("IIG", True), ("IIG", False), ("GGG", True), ("GGG", False)]  # (strategy, use_reentrant)


# ---- what each rank runs (and the single-process references) ----


def build(name: str) -> torch.nn.Module:
    """"llama" | "qwen2" | "gpt2" | "llama-lora": the same weights in every process."""
    kind, _, lora = name.partition("-")
    return hf_models.make(kind, lora=LORA if lora else None)


def batch(rank: int, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, hf_models.VOCAB, (B, T), generator=gen)


def greedy(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)


def reference(name: str, world: int) -> dict[str, Any]:
    """One process, each step's batch = every rank's micro-batches side by side."""
    model = build(name)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for a in range(ACCUM):
            x = torch.cat([batch(r, step, a) for r in range(world)])
            loss = model(input_ids=x, labels=x).loss / ACCUM
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append((total, norm.item()))
    model.eval()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "generated": greedy(model), "logits": model(input_ids=PROMPT).logits.detach()}


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[float, float]]:
    """3 AdamW steps of 2 micro-steps each, the FSDP2 way: the gradients reduced to ``.grad`` on
    the last micro-step (``set_requires_gradient_sync``), torch's ``clip_grad_norm_`` over the
    parameters (a DTensor norm), ``opt.step()`` and nothing after it. (mean loss, norm) per step."""
    rank = dist.get_rank()
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for a in range(ACCUM):
            model.set_requires_gradient_sync(a == ACCUM - 1)
            x = batch(rank, step, a)
            loss = model(input_ids=x, labels=x).loss / ACCUM
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(((total / dist.get_world_size()).item(), norm.full_tensor().item()))
    return losses


def train(name: str, strategy: str) -> dict[str, Any]:
    """3 AdamW steps with 2 micro-steps on the sharded model (torch's AdamW over its
    parameters), then torch's full state dict, eval logits and greedy generation (a PeftModel
    generates through its base model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from paro_fsdp import init_paro_mesh, paro_shard

    model = paro_shard(build(name), init_paro_mesh(2), strategy)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    losses = train_steps(model, opt)
    model.eval()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in state.items()}, "generated": greedy(model),
            "logits": model(input_ids=PROMPT).logits.detach(), "memory": model.memory_report(opt),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            # this rank's elements (the parameters are DTensors: numel() is the whole tensor's)
            "optimizer_numel": sum(p.to_local().numel() for pg in opt.param_groups for p in pg["params"])}


def generate_cases(strategies: list[str]) -> dict[str, Any]:
    """``PeftModel.generate`` (which calls its base model's ``generate``, not its own forward)
    on the LoRA model sharded with each strategy, and where the root's hooks went."""
    from paro_fsdp import init_paro_mesh, paro_shard

    out: dict[str, Any] = {}
    for s in strategies:
        model = paro_shard(build("llama-lora"), init_paro_mesh(2), s)
        model.eval()
        out[s] = {"generated": greedy(model), "entry": type(model._paro_state.blocks[0].module).__name__}
    return out


def cast_cases(_: Any) -> dict[str, Any]:
    """A bf16 model given fp32 ``inputs_embeds``: cast by default (as FSDP2), refused as torch
    refuses it with ``cast_forward_inputs=False``."""
    from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard

    embeds = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(3))
    out: dict[str, Any] = {}
    model = paro_shard(build("llama"), init_paro_mesh(2), "IIG", mp=MixedPrecision(param_dtype=torch.bfloat16))
    with torch.no_grad():
        out["logits"] = model(inputs_embeds=embeds).logits
    model = paro_shard(build("llama"), init_paro_mesh(2), "IIG",
                       mp=MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    try:
        with torch.no_grad():
            model(inputs_embeds=embeds)
        out["uncast"] = "ran"
    except RuntimeError as exc:
        out["uncast"] = str(exc).splitlines()[0]
    gpt2 = paro_shard(build("gpt2"), init_paro_mesh(2), "IIG")
    out["gpt2_entry_is_root"] = gpt2._paro_state.blocks[0].module is gpt2
    return out


def export_cases(root: str) -> dict[str, Any]:
    """The sharded Llama after 3 steps, fp32 then bf16 mixed precision (IIG), written two ways:
    ``integrations.hf.save_model`` with the model's own config (``hf_<dtype>``) and transformers'
    ``save_pretrained`` from torch's full state dict on rank 0 (``pretrained_<dtype>``). Rank 0
    returns each run's full state dict and its parameters gathered whole (the fp32 masters)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
    from paro_fsdp.integrations import hf

    out: dict[str, Any] = {}
    for tag, mp in (("fp32", None), ("bf16", MixedPrecision(param_dtype=torch.bfloat16))):
        model = paro_shard(build("llama"), init_paro_mesh(2), "IIG", mp=mp)
        train_steps(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        hf.save_model(model, f"{root}/hf_{tag}", model.config)
        if dist.get_rank() == 0:
            out[tag] = {"params": params, "full": {k: v.detach().clone() for k, v in full.items()}}
            model.save_pretrained(f"{root}/pretrained_{tag}", state_dict=full)  # empties the dict it is given
        dist.barrier()
    return out


def load_cases(root: str) -> dict[str, Any]:
    """A folder ``save_pretrained`` wrote (rank 0), read by ``integrations.hf.load_weights`` into
    the Llama built on the meta device and sharded (IIG; fp32 and bf16 mixed precision; the LoRA
    model, ING, its base frozen): no call after the load, the next forward computes with the
    loaded weights. Rank 0 returns the parameters gathered whole and the eval logits."""
    from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
    from paro_fsdp.integrations import hf

    folder = f"{root}/folder"
    if dist.get_rank() == 0:
        hf_models.save_folder("llama", folder, seed=5)
    dist.barrier()
    out: dict[str, Any] = {}
    for tag, strategy, lora, mp in (
        ("fp32", "IIG", False, None),
        ("bf16", "IIG", False, MixedPrecision(param_dtype=torch.bfloat16)),
        ("lora", "ING", True, None),
    ):
        model = hf.build_meta(hf.read_config(folder))
        if lora:
            model = hf.add_lora(model, rank=4, target_modules=LORA["target_modules"])
        model = paro_shard(model, init_paro_mesh(2), strategy, mp=mp, blocks=hf.decoder_blocks(model),
                           param_init_fn=hf.init_for_load(seed=0))
        hf.materialise_buffers(model, torch.device("cpu"))
        loaded = hf.load_weights(model, folder)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=PROMPT).logits.float()
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        if dist.get_rank() == 0:
            out[tag] = {"loaded": loaded, "params": params, "logits": logits}
    return out


def checkpointing_cases(cases: list[tuple[str, bool]]) -> dict[tuple[str, bool], Any]:
    """transformers' own activation checkpointing (``gradient_checkpointing_enable``, reentrant
    or not) on the Llama before ``paro_shard``, then the training of ``train``: its losses and
    full parameters, or the error that stopped it (type, message, innermost frame)."""
    import traceback

    from paro_fsdp import init_paro_mesh, paro_shard

    out: dict[tuple[str, bool], Any] = {}
    for strategy, reentrant in cases:
        model = build("llama")
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model = paro_shard(model, init_paro_mesh(2), strategy)
        try:
            losses = train_steps(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
        except Exception as exc:  # noqa: BLE001  (reported by the test)
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            out[(strategy, reentrant)] = {"error": f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"}
            continue
        out[(strategy, reentrant)] = {
            "losses": losses,
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        }
    return out


def rank_main(payload: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"train": {case: train(*case) for case in payload["train"]},
                           "generate": generate_cases(payload["generate"]), "cast": cast_cases(None),
                           "export": export_cases(payload["root"]), "load": load_cases(payload["root"]),
                           "checkpointing": checkpointing_cases(payload["checkpointing"])}
    return out


# ---- the checks ----


@pytest.fixture(scope="module")
def export_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_export"))


@pytest.fixture(scope="module")
def world(export_root):
    return run_world(WORLD, rank_main, {"train": TRAIN, "generate": NAMED, "root": export_root,
                                        "checkpointing": CHECKPOINTING})


@pytest.fixture(scope="module")
def refs():
    return {name: reference(name, WORLD) for name in sorted({n for n, _ in TRAIN})}


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
            # 2e-5 as the other parameter checks: AdamW divides by sqrt(v), so an element whose
            # gradients are near zero moves by up to lr (1e-3) on float noise in the summation order
            # (GPT-2's c_fc under IIG: 1.09e-5 with transformers 5.24)
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=2e-5, msg=key)
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
    ref = greedy(build("llama-lora").eval())
    for rank in world:
        got = rank["generate"][strategy]
        assert got["entry"] == "LlamaForCausalLM"
        assert torch.equal(got["generated"], ref)


def test_floating_inputs_are_cast_to_the_param_dtype(world):
    """A bf16 model takes fp32 ``inputs_embeds`` (cast as FSDP2's ``cast_forward_inputs``), and
    computes what the bf16 model computes on bf16 inputs; ``cast_forward_inputs=False`` leaves
    them, and torch refuses the mix."""
    model = build("llama").to(torch.bfloat16)
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


@pytest.mark.parametrize("how", ["hf", "pretrained"])
@pytest.mark.parametrize("tag", ["fp32", "bf16"])
def test_export_names_the_model_class_and_reloads_the_trained_weights(world, export_root, how, tag):
    """A sharded model's class keeps its name (FSDP2's contract): ``config.json`` names
    ``LlamaForCausalLM``, never a wrapper class, whether written by ``integrations.hf.save_model``
    from the model's own config or by transformers' ``save_pretrained`` (on the full state dict),
    and ``from_pretrained`` loads the trained fp32 parameters (under bf16 mixed precision too)."""
    import json

    from transformers import AutoModelForCausalLM

    folder = f"{export_root}/{how}_{tag}"
    with open(f"{folder}/config.json") as f:
        written = json.load(f)
    assert written.get("architectures") == ["LlamaForCausalLM"], written.get("architectures")
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    params = world[0]["export"][tag]["params"]
    state = loaded.state_dict()
    for name, value in params.items():
        assert value.dtype == torch.float32, name
        assert torch.equal(state[name], value), name


def test_bf16_full_state_dict_is_the_fp32_parameters(world):
    """Under bf16 mixed precision torch's full state dict (``get_model_state_dict(...,
    full_state_dict=True)``) holds the fp32 parameters (the masters), not the bf16 working
    copies: every entry fp32 and equal to the parameter gathered whole."""
    got = world[0]["export"]["bf16"]
    assert set(got["full"]) >= set(got["params"])
    for name, value in got["params"].items():
        assert got["full"][name].dtype == torch.float32, (name, got["full"][name].dtype)
        assert value.dtype == torch.float32, (name, value.dtype)
        assert torch.equal(got["full"][name], value), name
    # and the bf16 run trained away from the fp32 one (the comparison is not of untouched weights)
    fp32 = world[0]["export"]["fp32"]["params"]
    assert any(not torch.equal(fp32[n], v) for n, v in got["params"].items())


@pytest.mark.parametrize("strategy,reentrant", CHECKPOINTING, ids=[f"{s}-reentrant_{r}" for s, r in CHECKPOINTING])
def test_transformers_gradient_checkpointing_matches_one_process(world, refs, strategy, reentrant):
    """``model.gradient_checkpointing_enable()`` (reentrant or not) before ``paro_shard``:
    training as one process without checkpointing (recomputation changes no value), on every
    rank. transformers 5 checkpoints each decoder layer's ``forward``, not its ``__call__``, so
    the engine's hooks are outside the recomputation (before the engine's fix, 80a67ab, the
    recomputed forward met the OS-level DTensors: "aten.mul.Tensor got mixed torch.Tensor and
    DTensor" in LlamaRMSNorm)."""
    ref = refs["llama"]
    for rank in world:
        got = rank["checkpointing"][(strategy, reentrant)]
        assert "error" not in got, got["error"]
        for (loss, norm), (ref_loss, ref_norm) in zip(got["losses"], ref["losses"]):
            assert loss == pytest.approx(ref_loss, rel=1e-6), (loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=1e-5), (norm, ref_norm)
        for key, value in got["params"].items():
            torch.testing.assert_close(value, ref["state"][key], rtol=0, atol=2e-5, msg=key)


@pytest.mark.parametrize("tag", ["fp32", "bf16", "lora"])
def test_load_weights_reads_into_the_parameters(world, export_root, tag):
    """``load_weights`` on the model built on the meta device: every parameter (the fp32
    masters; LoRA's frozen base too) holds the folder's tensor exactly, and the first forward,
    with nothing called after the load, computes what ``from_pretrained`` computes (bf16 P: to
    bf16 rounding)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(f"{export_root}/folder", dtype=torch.float32).eval()
    stored = ref.state_dict()
    got = world[0]["load"][tag]
    base = {n: v for n, v in got["params"].items() if ".lora_" not in n}
    assert got["loaded"] == len(base) == len(stored)
    for name, value in base.items():
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert value.dtype == torch.float32, (name, value.dtype)
        assert torch.equal(value, stored[key]), name
    with torch.no_grad():
        want = ref(input_ids=PROMPT).logits
    # LoRA: B starts at zero (init_for_load), so the adapters add nothing yet
    atol = 5e-2 if tag == "bf16" else 1e-5
    torch.testing.assert_close(got["logits"], want, rtol=0, atol=atol)
