"""What each rank runs in tests/test_hf.py: Hugging Face models (and a peft LoRA adapter) under
``paro_shard`` on a 2 x 2 gloo world, and the single-process references they are compared with."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import hf_models

B, T, STEPS, ACCUM, LR, MAX_NORM = 2, 12, 3, 2, 1e-3, 1.0
PROMPT = torch.tensor([[3, 17, 29, 101, 5, 64]])
NEW_TOKENS = 6
LORA = {"target_modules": ["q_proj", "v_proj"]}


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


def train(name: str, strategy: str) -> dict[str, Any]:
    """3 AdamW steps with 2 micro-steps on the sharded model, then torch's full state dict, eval
    logits and greedy generation (a PeftModel generates through its base model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from paro_fsdp import ParoOptimizer, init_paro_mesh, paro_shard

    rank = dist.get_rank()
    model = paro_shard(build(name), init_paro_mesh(2), strategy)
    opt = ParoOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for a in range(ACCUM):
            x = batch(rank, step, a)
            loss = model(input_ids=x, labels=x).loss / ACCUM
            loss.backward()
            total += loss.detach()
        norm = opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(((total / dist.get_world_size()).item(), norm.item()))
    model.eval()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in state.items()}, "generated": greedy(model),
            "logits": model(input_ids=PROMPT).logits.detach(), "memory": model.memory_report(opt),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "optimizer_numel": sum(p.numel() for pg in opt.param_groups for p in pg["params"])}


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


def suite(payload: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"train": {case: train(*case) for case in payload["train"]},
                           "generate": generate_cases(payload["generate"]), "cast": cast_cases(None)}
    return out
