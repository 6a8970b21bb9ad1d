"""``strategy="auto"`` under three budgets on three models, the plan's predicted peak per rank beside
the peak measured while it trains: does the budget hold?

The models: the bench's Llama (``debug``, the shape the cost model was fitted on), a Hugging Face
Llama with LoRA on q/v (from a config, no download), and two of a user's own shape, their loss
computed outside the model: a transformer LM from torch's layers (``gpt``) and residual MLP blocks
(``mlp``, whose activations are about its parameters' size rather than many times it). Each is planned
as a user would plan it, ``paro_shard(model, mesh, "auto", memory_budget=B,
workload=Workload(example_inputs=<its first micro-batch>, grad_accum=A), cluster=...)``: the
activations are measured from the model (``cost/workload_probe.py``), not assumed. The budgets:
between GGG's and IIG's predicted peaks (tight: a mix), between IIG's and NIG's, and none (the
fastest single strategy that fits the cluster). Each plan is made three times (the same plan each
time: ``repeat``), then trained for two steps of ``--accum`` micro-steps; the second step's peak is
measured as ``tools.bench.memory_peak`` measures it (CPU: the profiler's allocation events; CUDA:
``max_memory_allocated``), the least rank's (the profiler misses the frees gloo's threads make).

    python -m tools.bench.auto_budget [--models llama,hf-lora,mine] [--micro-batch 2 --seq-len 64]

Not a timing benchmark: small models on 4 local gloo ranks (2 groups x 2).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

MODELS = ("llama", "hf-lora", "gpt", "mlp")
STEP = "paro_measured_step"


def _model(kind: str, seq_len: int) -> Any:
    """The unsharded model, the same on every rank (seed 0)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "llama":
        from paro_fsdp.models.llama import Llama, flavor

        return Llama(flavor("debug", max_seq_len=seq_len))
    if kind in ("hf", "hf-lora"):
        import peft
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=seq_len + 1)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if kind == "hf":
            return model
        return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    if kind == "gpt":  # a user's own transformer LM from torch's layers: pre-norm, learned positions, GELU
        class GPT(nn.Module):
            def __init__(self, vocab: int = 512, dim: int = 128, blocks: int = 4) -> None:
                super().__init__()
                self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
                self.blocks = nn.ModuleList(
                    nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                               norm_first=True) for _ in range(blocks))
                self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                t = x.shape[1]
                h = self.emb(x) + self.pos(torch.arange(t, device=x.device))
                mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
                for b in self.blocks:
                    h = b(h, src_mask=mask, is_causal=True)
                return self.head(self.norm(h))

        return GPT()
    if kind == "mlp":  # a user's own residual MLP: activations about its parameters' size, not many times it
        class MLP(nn.Module):
            def __init__(self, vocab: int = 512, dim: int = 128, blocks: int = 4) -> None:
                super().__init__()
                self.emb = nn.Embedding(vocab, dim)
                self.blocks = nn.ModuleList(
                    nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                    for _ in range(blocks))
                self.head = nn.Linear(dim, vocab)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.emb(x)
                for b in self.blocks:
                    h = h + b(h)
                return self.head(h)

        return MLP()
    raise ValueError(f"--models: {kind!r} is not one of {', '.join(MODELS)}")


def _batches(kind: str, n: int, micro_batch: int, seq_len: int, rank: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(rank)
    vocab = 512 if kind != "llama" else 256
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
        out.append({"input_ids": t[:, :-1], "labels": t[:, :-1]} if kind.startswith("hf") else t)
    return out


def _example(kind: str, payload: dict) -> Any:
    """One micro-batch as the model's forward takes it: auto's ``example_inputs``."""
    batch = _batches(kind, 1, payload["micro_batch"], payload["seq_len"], 0)[0]
    return batch[:, :-1] if kind in ("gpt", "mlp") else batch


def _loss(kind: str, model: Any, batch: Any) -> Any:
    if kind == "llama":
        return model(batch).loss
    if kind.startswith("hf"):
        return model(**batch).loss
    return _outside_loss(batch)(model(batch[:, :-1]))  # a user's model: the loss outside it


def _outside_loss(batch: Any) -> Any:
    """The loss a user's loop computes from the logits (next-token cross-entropy)."""
    import torch.nn.functional as F

    return lambda logits: F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _workload(kind: str, payload: dict) -> Any:
    """auto's workload as a user gives it: one micro-batch, the micro-steps, a loss outside the model."""
    from paro_fsdp.cost.budget import Workload

    batch = _batches(kind, 1, payload["micro_batch"], payload["seq_len"], 0)[0]
    outside = _outside_loss(batch) if kind in ("gpt", "mlp") else None
    return Workload(example_inputs=_example(kind, payload), grad_accum=payload["accum"], loss_fn=outside)


def _plans(kind: str, payload: dict, n: int, m: int) -> list[tuple[Optional[float], Any]]:
    """(budget, plan) at the three budgets, from the singles' predicted peaks."""
    import torch

    from paro_fsdp.api import _default_blocks
    from paro_fsdp.cost.budget import Workload, plan_blocks, seen_workload, spec_of, units_of
    from paro_fsdp.cost.cluster import load_cluster

    model = _model(kind, payload["seq_len"])
    spec = spec_of(model, Workload())
    seen, _ = seen_workload(model, _workload(kind, payload), spec, torch.float32, True, _default_blocks(model))
    cluster = load_cluster(payload["cluster"])

    def plan(budget: Optional[float]) -> Any:
        return plan_blocks(units_of(model, _default_blocks(model)), n, m, budget, cluster, seen, spec, 4, 4, 4)

    single = {s: f for s, f, _ in plan(None).single}
    budgets = [(single["GGG"] + single["IIG"]) / 2, (single["IIG"] + single["NIG"]) / 2, None]
    return [(b, plan(b)) for b in budgets]


def _one(kind: str, budget: Optional[float], payload: dict, mesh: Any) -> dict:
    import contextlib
    import gc
    import io

    import torch
    import torch.distributed as dist

    from paro_fsdp import paro_shard

    from .memory_peak import _cpu_peak

    rank, accum = dist.get_rank(), payload["accum"]
    batches = _batches(kind, 2 * accum, payload["micro_batch"], payload["seq_len"], rank)
    work = _workload(kind, payload)
    headers, plans = [], []

    def shard() -> Any:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            model = paro_shard(_model(kind, payload["seq_len"]), mesh, "auto", memory_budget=budget,
                               workload=work, cluster=payload["cluster"])
        headers.append(printed.getvalue().splitlines()[:1])
        plans.append(sorted((k, getattr(v, "name", str(v))) for k, v in model.paro_strategies().items()))
        return model

    for _ in range(2):  # three plans, as three runs would make them (the third below): the same each time
        shard()
        gc.collect()  # its engine (reference cycles) is not freed inside the measured one's window

    def run() -> tuple[Any, Any, Any]:
        model = shard()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def step(k: int) -> None:
            for micro in range(accum):
                model.set_requires_gradient_sync(micro == accum - 1)
                (_loss(kind, model, batches[k * accum + micro]) / accum).backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            opt.zero_grad()
        step(0)
        return model, opt, step

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, opt, step = run()
        with record_function(STEP):
            step(1)
    peak, _ = _cpu_peak(prof)
    strategies = dict(plans[-1])
    del model, opt
    return {"model": kind, "budget": budget, "measured": peak, "repeat": all(p == plans[0] for p in plans),
            "strategies": strategies, "header": headers[0]}


def _rank_main(payload: dict) -> list[dict]:
    from paro_fsdp import init_paro_mesh

    mesh = init_paro_mesh(payload["group_size"])
    out = []
    for kind in payload["models"]:
        for budget in payload["budgets"][kind]:
            out.append(_one(kind, budget, payload, mesh))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.auto_budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--cluster", default="a100_ib", help="a preset or cluster TOML (auto's cluster=)")
    a = ap.parse_args(argv)
    from tools.local_world import run_local_world

    payload = {"models": a.models.split(","), "group_size": a.group_size, "micro_batch": a.micro_batch,
               "seq_len": a.seq_len, "accum": a.accum, "cluster": a.cluster}
    plans = {k: _plans(k, payload, a.nproc, a.group_size) for k in payload["models"]}
    payload["budgets"] = {k: [b for b, _ in v] for k, v in plans.items()}
    per_rank = run_local_world(a.nproc, "tools.bench.auto_budget:_rank_main", payload, timeout=1800)
    MiB = 2**20
    print(f"auto under a budget, {a.nproc} ranks = {a.nproc // a.group_size} groups x {a.group_size}, micro-batch "
          f"{a.micro_batch} x {a.seq_len}, {a.accum} micro-steps, fp32, cluster {a.cluster}")
    head = (f"{'model':8} {'budget MiB':>10} {'plan':34} {'predicted':>9} {'measured':>9} {'meas/pred':>9} "
            f"{'<= budget':>9} {'same x3':>7}")
    print(head + "\n" + "-" * len(head))
    ok = True
    for i, r in enumerate(per_rank[0]):
        kind, budget = r["model"], r["budget"]
        plan = dict(plans[kind])[budget]
        measured = min(rank[i]["measured"] for rank in per_rank)
        same = r["repeat"] and all(rank[i]["strategies"] == r["strategies"] for rank in per_rank) \
            and r["strategies"] == {k: v.name for k, v in plan.strategies().items()}
        limit = budget if budget is not None else plan.budget
        fits = measured <= limit
        ratio = measured / plan.footprint
        ok &= fits and same and 0.9 <= ratio <= 1.1
        names = sorted({v.name for v in plan.strategies().values()})
        print(f"{kind:8} {('none' if budget is None else f'{budget / MiB:.2f}'):>10} {' '.join(names)[:34]:34} "
              f"{plan.footprint / MiB:9.2f} {measured / MiB:9.2f} {ratio:9.3f} {str(fits):>9} {str(same):>7}")
        print(f"         {r['header'][0][:150] if r['header'] else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
