"""A practitioner's FSDP2 fine-tuning script for a Hugging Face model, run with torch's
``fully_shard`` and with ours by changing only that import (plus a strategy): a tiny Llama and
Qwen2 made from configs, a 2D mesh of its own (HSDP's names), decay and no-decay groups,
transformers' cosine schedule with warmup, ``set_requires_gradient_sync`` accumulation, torch's
``clip_grad_norm_``, transformers' gradient checkpointing, ``get_state_dict`` save and resume
through DCP, and a ``get_model_state_dict(full_state_dict=True)`` + ``save_pretrained`` export.
Losses and gradient norms must equal FSDP2's to 1e-5 (fp32), with no strategy and with IIG."""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from hf_models import VOCAB, make

STEPS, A, LR, MAX_NORM, B, T = 4, 2, 2e-3, 1.0, 2, 16


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB - 16, (B, T), generator=gen)


def _setup(impl: str, strategy: str | None, kind: str, reentrant: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import get_cosine_schedule_with_warmup

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from paro_fsdp import fully_shard  # the one line that changes
    kw = {"strategy": strategy} if strategy else {}

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n or n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not any(p is q for q in no_decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    return model, opt, sched


def _hf_loss(model, rank: int, step: int, micro: int) -> torch.Tensor:
    x = _batch(rank, step, micro)
    return model(input_ids=x, labels=x).loss


def _steps(model, opt, sched, steps: range) -> list[tuple[float, float]]:
    from test_fully_shard import _train

    return _train(model, opt, sched, steps, loss_of=_hf_loss, accum=A, max_norm=MAX_NORM)


def finetune(payload: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)

    impl, strategy, kind, reentrant, folder = (payload[k] for k in ("impl", "strategy", "kind", "reentrant", "folder"))
    folder = os.path.join(folder, f"{impl}-{strategy}-{kind}-{reentrant}")
    model, opt, sched = _setup(impl, strategy, kind, reentrant)
    losses = _steps(model, opt, sched, range(STEPS // 2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{folder}/ckpt")
    losses += _steps(model, opt, sched, range(STEPS // 2, STEPS))

    # resume into a fresh model: the same last steps
    fresh, fopt, fsched = _setup(impl, strategy, kind, reentrant)
    fmsd, fosd = get_state_dict(fresh, fopt)
    state = {"model": fmsd, "optim": fosd}
    dcp.load(state, checkpoint_id=f"{folder}/ckpt")
    set_state_dict(fresh, fopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for _ in range(STEPS // 2):
        fsched.step()
    resumed = _steps(fresh, fopt, fsched, range(STEPS // 2, STEPS))

    # export: a full state dict, saved by rank 0 with transformers
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    arch = dtypes = kept = None
    if dist.get_rank() == 0:
        kept = {k: v.clone() for k, v in full.items()}  # save_pretrained empties the dict it is given
        dtypes = sorted({str(v.dtype) for v in full.values()})
        model.save_pretrained(f"{folder}/export", state_dict=full)
        with open(f"{folder}/export/config.json") as f:
            arch = json.load(f)["architectures"]
    dist.barrier()
    return {"losses": losses, "resumed": resumed, "architectures": arch, "dtypes": dtypes, "full": kept}


def all_runs(payload: list[dict]) -> list[dict]:
    return [finetune(p) for p in payload]


CASES = [("torch", None, "llama", False), ("paro", None, "llama", False), ("paro", "IIG", "llama", False)]
# the slow set: reentrant checkpointing, and Qwen2
SLOW_CASES = [("paro", "IIG", "llama", True), ("torch", None, "qwen2", False), ("paro", "IIG", "qwen2", False)]


def _world(cases: list[tuple], folder: str) -> dict[tuple, dict]:
    payload = [{"impl": i, "strategy": s, "kind": k, "reentrant": r, "folder": folder} for i, s, k, r in cases]
    return dict(zip(cases, run_world(4, all_runs, payload)[0]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request) -> dict[tuple, dict]:
    folder = str(tmp_path_factory.mktemp("hf_fsdp2"))
    slow = request.config.getoption("-m") != "not slow"
    return _world(CASES + (SLOW_CASES if slow else []), folder)


def _close(got: list, ref: list, tol: float = 1e-5) -> None:
    assert len(got) == len(ref)
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert abs(loss - ref_loss) <= tol * abs(ref_loss), (loss, ref_loss)
        assert abs(norm - ref_norm) <= tol * abs(ref_norm), (norm, ref_norm)


def _id(c: tuple) -> str:
    return f"{c[1] or 'default'}-{c[2]}{'-reentrant' if c[3] else ''}"


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "paro"] +
                         [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES if c[0] == "paro"], ids=_id)
def test_the_script_with_its_import_changed_matches_fsdp2(runs, case):
    ref = runs[("torch", None, case[2], False)]
    got = runs[case]
    _close(got["losses"], ref["losses"])
    _close(got["resumed"], got["losses"][STEPS // 2:])  # get_state_dict save and resume
    assert (
        got["architectures"]
        == ref["architectures"]
        == ["LlamaForCausalLM" if case[2] == "llama" else "Qwen2ForCausalLM"]
    )
    assert got["dtypes"] == ["torch.float32"]
    assert got["full"].keys() == ref["full"].keys() and len(ref["full"]) > 10
    for name, value in ref["full"].items():
        torch.testing.assert_close(got["full"][name], value, rtol=1e-4, atol=1e-5, msg=name)
