"""Does ``auto``'s budget hold in physical memory? Each rank's resident high-water mark over two training
steps, above its resident size before the model existed, at three budgets per model, beside the plan's
predicted peak and the budget.

Why: ``tools.bench.auto_budget`` measures the bytes torch allocates (the profiler's events); a process
also holds what it never counts: the allocator's free lists, gloo's buffers, the autograd graph's nodes,
Python objects. On models of 20M+ parameters the interpreter's own memory is small beside the model's,
so the ratio says how much of what a rank really holds the prediction misses.

How: 4 gloo ranks (2 x 2), fp32, each rank's glibc mmap threshold fixed at 128 KiB (``mallopt``: every
tensor of a block's size or more is its own mapping, returned to the system when freed, so the resident
size follows the live tensors instead of the heap's high tide); the baseline is the resident size before
the model is built; the model is built, planned (``paro_shard(..., "auto", memory_budget=B,
workload=Workload(example_inputs=..., loss_fn=...))``, cluster ``a100_ib``) and sharded, the kernel's
high-water mark reset (``/proc/self/clear_refs``), then two steps of ``--accum`` micro-steps with AdamW
and clipping; the mark read (``VmHWM``). On a GPU ``max_memory_allocated`` would be the measure; this
runs on CPU ranks. The budgets: between GGG's and IIG's predicted peaks, between IIG's and NIG's, none.

    python -m tools.bench.auto_physical [--models gpt,vit] [--micro-batch 2 --seq-len 128]

Not a timing benchmark. Linux only (``/proc``).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

MODELS = ("gpt", "vit")
MiB = 2**20


def _model(kind: str, seq_len: int) -> Any:
    """A 27M-parameter transformer LM of torch's layers, or a 25M-parameter ViT (root parameters, loss outside)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "gpt":
        class GPT(nn.Module):
            def __init__(self, vocab: int = 8192, dim: int = 512, blocks: int = 6) -> None:
                super().__init__()
                self.emb, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq_len, dim))
                self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.0, batch_first=True,
                                                                       norm_first=True) for _ in range(blocks))
                self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.emb(x) + self.pos[: x.shape[1]]
                mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
                for b in self.blocks:
                    h = b(h, src_mask=mask, is_causal=True)
                return self.head(self.norm(h))

        return GPT()
    if kind == "vit":
        class ViT(nn.Module):
            def __init__(self, dim: int = 512, depth: int = 8, image: int = 64, patch: int = 8) -> None:
                super().__init__()
                self.patch = nn.Conv2d(3, dim, patch, patch)
                self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
                self.cls = nn.Parameter(torch.zeros(1, 1, dim))
                self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.0, batch_first=True)
                                            for _ in range(depth))
                self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 1000)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.patch(x).flatten(2).transpose(1, 2)
                h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos
                for layer in self.layers:
                    h = layer(h)
                return self.head(self.norm(h[:, 0]))

        return ViT()
    raise ValueError(f"--models: {kind!r} is not one of {', '.join(MODELS)}")


def _batch(kind: str, payload: dict, rank: int, k: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + k)
    b = payload["micro_batch"]
    if kind == "vit":
        return torch.randn(b, 3, 64, 64, generator=g), torch.randint(0, 1000, (b,), generator=g)
    t = torch.randint(0, 8192, (b, payload["seq_len"] + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _loss_fn(targets: Any) -> Any:
    import torch.nn.functional as F

    return lambda logits: F.cross_entropy(logits.flatten(0, -2) if logits.dim() > 2 else logits, targets.flatten())


def _workload(kind: str, payload: dict) -> Any:
    from paro_fsdp.cost.budget import Workload

    x, y = _batch(kind, payload, 0, 0)
    return Workload(example_inputs=x, grad_accum=payload["accum"], loss_fn=_loss_fn(y))


def _plans(kind: str, payload: dict, n: int, m: int) -> list[tuple[Optional[float], Any]]:
    """(budget, plan) at the three budgets, as ``paro_shard`` plans them."""
    import torch

    from paro_fsdp.api import _default_blocks
    from paro_fsdp.cost.budget import Workload, plan_blocks, seen_workload, spec_of, units_of
    from paro_fsdp.cost.cluster import load_cluster

    model = _model(kind, payload["seq_len"])
    blocks = _default_blocks(model)
    spec = spec_of(model, Workload())
    seen, _ = seen_workload(model, _workload(kind, payload), spec, torch.float32, True, blocks)

    def plan(budget: Optional[float]) -> Any:
        return plan_blocks(units_of(model, blocks), n, m, budget, load_cluster("a100_ib"), seen, spec, 4, 4, 4)

    single = {s: f for s, f, _ in plan(None).single}
    budgets = [(single["GGG"] + single["IIG"]) / 2, (single["IIG"] + single["NIG"]) / 2, None]
    return [(b, plan(b)) for b in budgets]


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return float(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _one(kind: str, budget: Optional[float], payload: dict, mesh: Any) -> dict:
    import contextlib
    import gc
    import io

    import torch
    import torch.distributed as dist

    from paro_fsdp import paro_shard

    rank, accum = dist.get_rank(), payload["accum"]
    batches = [_batch(kind, payload, rank, k) for k in range(2 * accum)]
    work = _workload(kind, payload)
    gc.collect()
    dist.barrier()
    base = _status("VmRSS")
    with contextlib.redirect_stdout(io.StringIO()):
        model = paro_shard(_model(kind, payload["seq_len"]), mesh, "auto", memory_budget=budget, workload=work,
                           cluster="a100_ib")
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark from here: the steps
        f.write("5")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    for step in range(2):
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            x, y = batches[step * accum + micro]
            (_loss_fn(y)(model(x)) / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    peak = _status("VmHWM") - base
    states = model.memory_report(opt)
    del model, opt, params
    gc.collect()
    dist.barrier()
    return {"model": kind, "budget": budget, "measured": peak, "report": states}


def _rank_main(payload: dict) -> list[dict]:
    import ctypes

    from paro_fsdp import init_paro_mesh

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD, fixed (no dynamic raise)
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    mesh = init_paro_mesh(payload["group_size"])
    return [_one(kind, budget, payload, mesh) for kind in payload["models"] for budget in payload["budgets"][kind]]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.auto_physical", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--accum", type=int, default=2)
    a = ap.parse_args(argv)
    from tools.local_world import run_local_world

    payload = {"models": a.models.split(","), "group_size": a.group_size, "micro_batch": a.micro_batch,
               "seq_len": a.seq_len, "accum": a.accum}
    plans = {k: _plans(k, payload, a.nproc, a.group_size) for k in payload["models"]}
    payload["budgets"] = {k: [b for b, _ in v] for k, v in plans.items()}
    per_rank = run_local_world(a.nproc, "tools.bench.auto_physical:_rank_main", payload, timeout=3600)
    print(f"auto's budget in physical memory, {a.nproc} ranks = {a.nproc // a.group_size} groups x {a.group_size}, "
          f"fp32, micro-batch {a.micro_batch}, {a.accum} micro-steps; resident high-water mark above the pre-model "
          f"baseline, the largest rank's")
    head = (f"{'model':6} {'params':>7} {'budget MiB':>10} {'plan':24} {'predicted':>9} {'measured':>9} "
            f"{'meas/pred':>9} {'<= budget':>9}")
    print(head + "\n" + "-" * len(head))
    ok = True
    for i, r in enumerate(per_rank[0]):
        kind, budget = r["model"], r["budget"]
        plan = dict(plans[kind])[budget]
        measured = max(rank[i]["measured"] for rank in per_rank)
        limit = budget if budget is not None else plan.budget
        ratio = measured / plan.footprint
        ok &= measured <= limit and ratio <= 1.1
        names = " ".join(sorted({v.name for v in plan.strategies().values()}))
        numel = sum(u.numel for b in plan.blocks for u in b.units)
        print(f"{kind:6} {numel / 1e6:6.1f}M {('none' if budget is None else f'{budget / MiB:.1f}'):>10} "
              f"{names[:24]:24} {plan.footprint / MiB:9.1f} {measured / MiB:9.1f} {ratio:9.3f} "
              f"{str(measured <= limit):>9}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
