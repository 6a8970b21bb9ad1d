"""Does a quantized inter wire hold the loss? The debug Llama and a Hugging Face model (a tiny
Qwen2 built from its config, no download) trained on real text, the Python standard library's
docstrings (the corpus the trainer embeds), with and without ``MixedPrecision.inter_dtype``.

    python -m tools.bench.convergence                         # GGG, 300 steps, none / int8 / int4
    python -m tools.bench.convergence --steps 50 --models llama --wires none,int8   # a quick look

Every run: 4 gloo ranks as 2 groups of 2 (``tools.local_world``), the same init and data, AdamW,
clip 1.0, cosine decay, fp32 (so an int8 wire is 3.94x fewer bytes than the exact one). The last
5% of the corpus's windows is held out: its mean loss (every held-out window, every rank's share)
is measured every ``--eval-every`` steps and at the end. Curves go to TensorBoard
(``<out>/tb/<model>-<wire>``: ``loss/train``, ``loss/held_out``) and to one PNG; the table gives the
final held-out loss and its ratio to the exact run's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from tools.local_world import run_local_world

HELD_OUT = 0.05


def _model(name: str, vocab: int, seq: int) -> Any:
    import torch

    torch.manual_seed(0)
    if name == "llama":
        from paro_fsdp.models.llama import Llama, LlamaArgs

        return Llama(LlamaArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=vocab, ffn_dim=344,
                               max_seq_len=seq))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def _loss(model: Any, name: str, window: Any) -> Any:
    if name == "llama":
        return model(window).loss
    return model(input_ids=window, labels=window).loss  # transformers shifts the labels


def rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
    from paro_fsdp.train.data import load_documents, pack_windows, tokenize_documents
    from paro_fsdp.train.tokenizer import ByteTokenizer

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = ByteTokenizer()
    windows = pack_windows(tokenize_documents(load_documents("embedded"), tok), cfg["seq"])
    cut = int(len(windows) * (1 - HELD_OUT))
    train, held = windows[:cut], windows[cut:]
    order = np.random.default_rng(0).permutation(len(train))
    mine = held[rank::world]
    b, accum, steps = cfg["batch"], cfg["accum"], cfg["steps"]
    mesh = init_paro_mesh(2)
    wire = None if cfg["wire"] == "none" else cfg["wire"]
    model = paro_shard(_model(cfg["model"], tok.vocab_size, cfg["seq"]), mesh, cfg["strategy"],
                       mp=MixedPrecision(inter_dtype=wire))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))

    def held_out() -> float:
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for i in range(0, len(mine), b):
                part = torch.from_numpy(mine[i:i + b].astype(np.int64))
                total += torch.tensor([_loss(model, cfg["model"], part).item() * len(part), len(part)])
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    curve, evals = [], []
    for step in range(steps):
        total = torch.zeros(())
        for a in range(accum):
            model.set_requires_gradient_sync(a == accum - 1)
            start = ((step * accum + a) * world + rank) * b
            rows = order[np.arange(start, start + b) % len(order)]
            loss = _loss(model, cfg["model"], torch.from_numpy(train[rows].astype(np.int64))) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        dist.all_reduce(total)
        curve.append((total / world).item())
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
            evals.append((step + 1, held_out()))
    return {"train": curve, "held_out": evals, "comm": model.comm_stats().as_dict()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama,hf")
    p.add_argument("--wires", default="none,int8,int4")
    p.add_argument("--strategy", default="GGG")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--batch", type=int, default=4, help="windows per rank per micro-step")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out-dir", default="outputs/convergence")
    p.add_argument("--plot", default=None, help="PNG of the curves (default <out-dir>/convergence.png)")
    args = p.parse_args(argv)
    from torch.utils.tensorboard import SummaryWriter

    os.makedirs(args.out_dir, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        for wire in args.wires.split(","):
            cfg = {"model": model, "wire": wire, "strategy": args.strategy, "steps": args.steps, "seq": args.seq,
                   "batch": args.batch, "accum": args.accum, "lr": args.lr, "eval_every": args.eval_every}
            out = run_local_world(4, "tools.bench.convergence:rank_main", cfg, timeout=3600)[0]
            results[f"{model}-{wire}"] = out
            with SummaryWriter(os.path.join(args.out_dir, "tb", f"{model}-{wire}")) as tb:
                for i, v in enumerate(out["train"]):
                    tb.add_scalar("loss/train", v, i + 1)
                for s, v in out["held_out"]:
                    tb.add_scalar("loss/held_out", v, s)
            inter = sum(v["bytes"] for k, v in out["comm"].items() if k.endswith("/inter"))
            print(f"{model:6} {wire:5} {args.strategy}: train {out['train'][-1]:.4f}, held-out "
                  f"{out['held_out'][-1][1]:.4f}, inter {inter / 2**20 / args.steps:.3f} MiB a step", flush=True)
    with open(os.path.join(args.out_dir, "convergence.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f)
    print(f"\n{args.strategy}, 4 ranks = 2 x 2, {args.steps} steps: final held-out loss")
    print(f"{'model':6} {'wire':5} {'held-out':>9} {'vs exact':>9}")
    for key, out in results.items():
        model, wire = key.split("-")
        final = out["held_out"][-1][1]
        exact = results.get(f"{model}-none")
        ratio = f"{final / exact['held_out'][-1][1]:9.4f}" if exact else "        -"
        print(f"{model:6} {wire:5} {final:9.4f} {ratio}")
    _plot(results, args.plot or os.path.join(args.out_dir, "convergence.png"), args.strategy)
    return 0


def _plot(results: dict[str, dict[str, Any]], path: str, strategy: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({k.split("-")[0] for k in results})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for key, out in results.items():
            if key.startswith(model + "-"):
                wire = key.split("-")[1]
                (line,) = ax.plot(range(1, len(out["train"]) + 1), out["train"], alpha=0.35, lw=0.8)
                steps, held = zip(*out["held_out"])
                ax.plot(steps, held, "o-", color=line.get_color(), label=f"{wire}: held-out {held[-1]:.3f}")
        ax.set(title=f"{model}, {strategy}, 2 x 2 ranks", xlabel="step", ylabel="loss (faint: train)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
