"""One rank of a peer run, in the peer's own venv under torchrun (``driver.py`` starts it on the
emulated cluster; plain ``torchrun --nproc-per-node 4`` works too, without tx bytes):

    .venv-peers/ds-0.19.8/bin/torchrun --standalone --nproc-per-node 4 \\
        -m tools.bench.peers.worker --peer ds-zero3 --accum 4 --warmup 0 --rounds 1 --steps-per-round 3

What it shares with PaRO's bench (``headline_worker.py``), so the rows compare the same work: the
bench Llama (or MLP stack) built with seed 0 on every rank, each micro-step's batch seeded by
(step, micro-step, rank), AdamW (lr, weight decay of ``workload.py``), clip 1.0, A micro-steps a
step, fp32; the timing (``--steps-per-round`` steps back to back from a barrier, the slowest
rank's time over K, the median of ``--rounds`` after ``--warmup``; each round again on unshaped
links for the compute-side limit), the kernel's tx bytes per step, the same row fields.

Model-state memory (``state_bytes``): what the peer allocates for the model, counted on the
objects it keeps (the engine / wrapped module and the optimizer, walked down to every tensor they
hold: parameter shards, gradient buffers, optimizer states, flat and bucket buffers, hpZ / MiCS
secondary copies), each storage once, between the last backward of a step and its optimizer
step, on a step after the first (the states exist); the max over ranks. Activations and the
model's non-persistent buffers (RoPE tables) are not model states and are not walked.

The check: the first ``--check-steps`` steps' losses (mean over ranks) against one process
training the same model on all ranks' batches (rank 0 runs it after the timed part): within
``RTOL`` it passes; a failing check marks the row (``check.ok`` false). Peers that run through an
approximate stand-in (qwZ / qgZ) are compared with ``APPROX_RTOL`` and marked approximate.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

from tools.bench.workload import MAX_NORM, make_optimizer
from tools.emulate.emulator import UNSHAPED, local_tx_bytes, parse_rate, set_link_rate
from tools.emulate.gloo_rs import install_from_env

from . import PEERS
from . import patches as P

RESULT_TAG = "PARO_PEER_JSON "
RTOL = 1e-6  # fp32: runs agree within ~2e-7 of ~7 over a few steps
APPROX_RTOL = 5e-2  # int8 / int4 quantized weights and gradients (the stand-in): close, not equal


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench.peers.worker")
    p.add_argument("--peer", required=True, choices=sorted(PEERS))
    for flag, v in (("dim", 128), ("layers", 4), ("heads", 4), ("kv-heads", 2), ("ffn", 352), ("vocab", 1024),
                    ("seq", 128), ("batch", 2)):
        p.add_argument(f"--{flag}", type=int, default=v)
    p.add_argument("--model", default="llama", choices=("llama", "mlp"))
    p.add_argument("--accum", default="1,4")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--no-limit", action="store_true")
    p.add_argument("--check-steps", type=int, default=3, help="steps checked against one process (0: none)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                   help="sgd (workload.SGD_LR, no momentum): gradients' scale shows in the losses (Adam hides it)")
    p.add_argument("--max-norm", type=float, default=MAX_NORM, help="gradient clipping (0: none)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="m, the ranks of a node (default: torchrun's LOCAL_WORLD_SIZE); set it under plain torchrun")
    p.add_argument("--no-patch", default="", help="comma-separated patches.PATCHES names to leave off")
    return p.parse_args(argv)


def make_model(args: argparse.Namespace) -> Any:
    import torch

    from paro_fsdp.models.llama import Llama, LlamaArgs
    from tools.bench.workload import MLPStack

    torch.manual_seed(0)
    if args.model == "mlp":
        return MLPStack(args.dim, args.ffn, args.layers, args.vocab)
    return Llama(LlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                           vocab_size=args.vocab, ffn_dim=args.ffn, max_seq_len=args.seq))


def batch(args: argparse.Namespace, rank: int, i: int, a: int) -> Any:
    """headline_worker's batch: seeded by (step, micro-step, rank)."""
    import torch

    gen = torch.Generator().manual_seed(10_000 * i + 100 * a + rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)


# ---- model-state memory ---------------------------------------------------------------------------
_WALK_MODULES = ("deepspeed", "megatron_fsdp", "torch.optim", "torch.nn", "tools.bench.peers", "paro_fsdp.models")
_SKIP_ATTRS = {"_buffers", "_non_persistent_buffers_set", "_forward_hooks", "_forward_pre_hooks",
               "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"}


def state_bytes(*roots: Any) -> int:
    """Bytes of every distinct storage reachable from ``roots`` through the peers' own objects
    (attributes, containers, tensors' attributes such as DeepSpeed's ``ds_tensor`` and their
    ``.grad``, DTensors' local shards); torch modules contribute their parameters and sub-modules, not their buffers."""
    import torch
    from torch.distributed.tensor import DTensor

    seen_obj: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack:
        o = stack.pop()
        if o is None or id(o) in seen_obj:
            continue
        seen_obj.add(id(o))
        if isinstance(o, DTensor):
            stack.append(o._local_tensor)
            stack.extend(vars(o).values())
            continue
        if isinstance(o, torch.Tensor):
            try:
                s = o.untyped_storage()
                storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
            except (RuntimeError, NotImplementedError):
                pass
            stack.extend(getattr(o, "__dict__", {}).values())
            if o.is_leaf:
                stack.append(o.grad)  # not in __dict__
            continue
        if isinstance(o, dict):
            stack.extend(o.values())
            stack.extend(k for k in o if isinstance(k, torch.Tensor))
            continue
        if isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
            continue
        mod = type(o).__module__ or ""
        if not mod.startswith(_WALK_MODULES) or callable(o) and not isinstance(o, torch.nn.Module):
            continue
        d = getattr(o, "__dict__", None)
        if d is None:
            continue
        stack.extend(v for k, v in d.items() if k not in _SKIP_ATTRS)
    storages.pop(0, None)  # empty (released) storages
    return sum(storages.values())


# ---- the one-process check ------------------------------------------------------------------------
def reference_losses(args: argparse.Namespace, world: int, steps: list[int]) -> list[float]:
    """One process: the same model, every rank's micro-batches each micro-step, the mean gradient
    (each loss / (A x world)), clip, the optimizer; the mean loss over ranks per step."""
    import torch

    model = make_model(args)
    opt = make_optimizer(model.parameters(), args.optimizer)
    out = []
    for i, accum in enumerate(steps):
        total = 0.0
        for a in range(accum):
            for r in range(world):
                loss = model(batch(args, r, i, a)).loss / (accum * world)
                loss.backward()
                total += loss.item()
        if args.max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        opt.step()
        opt.zero_grad()
        out.append(total)
    return out


# ---- the run --------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    # torch's JIT extension cache per venv: DeepSpeed builds its shm op (deepspeed_shm_comm) at comm
    # init under one name for every release, and a build of another release loaded here fails
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives, once per call site
    peer = PEERS[args.peer]
    active = P.active(peer, set(filter(None, args.no_patch.split(","))))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    install_from_env()
    n, rank = dist.get_world_size(), dist.get_rank()
    m = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    accums = [int(a) for a in args.accum.split(",")]
    uplinks = sorted(set(filter(None, os.environ.get("PARO_EMU_IFNAMES", "").split(","))))
    on_emulator = bool(uplinks)
    if peer.system == "deepspeed":
        from .deepspeed_peer import build
    else:
        from .mfsdp_peer import build
    run = build(peer, args, make_model(args), m, active)
    steps_run: list[int] = []  # accum of every step, in order
    losses: list[float] = []
    mem: list[int] = []
    # the memory probe: between the last backward and the optimizer step of the second step
    probe_at = 1

    def one_step(accum: int) -> None:
        i = len(steps_run)
        probe = (lambda: mem.append(state_bytes(*run.roots))) if i == probe_at else None
        loss = run.step(lambda a: batch(args, rank, i, a), accum, probe)
        steps_run.append(accum)
        losses.append(loss)

    def timed(accum: int) -> tuple[float, dict[str, float]]:
        before = local_tx_bytes(["lo", *uplinks]) if rank == 0 and on_emulator else {}
        dist.barrier()
        t = time.perf_counter()
        for _ in range(args.steps_per_round):
            one_step(accum)
        dt = torch.tensor([(time.perf_counter() - t) / args.steps_per_round], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        after = local_tx_bytes(["lo", *uplinks]) if rank == 0 and on_emulator else {}
        return dt.item(), {k: (after[k] - before[k]) / args.steps_per_round for k in after}

    def links(rate: str) -> None:
        dist.barrier()
        if rank == 0:
            set_link_rate(rate)
        dist.barrier()

    limit = on_emulator and not args.no_limit
    times: dict[int, list[float]] = {}
    unshaped: dict[int, list[float]] = {}
    sent: dict[int, list[dict[str, float]]] = {}
    for accum in accums:
        for rnd in range(args.warmup + args.rounds):
            t, s = timed(accum)
            if rnd >= args.warmup:
                times.setdefault(accum, []).append(t)
                sent.setdefault(accum, []).append(s)
            if limit and rnd >= args.warmup:
                links(UNSHAPED)
                unshaped.setdefault(accum, []).append(timed(accum)[0])
                links(os.environ["PARO_EMU_RATE"])
    if len(steps_run) <= probe_at:  # a one-step run: probe after it (no optimizer state)
        mem.append(state_bytes(*run.roots))
    # the mean loss over ranks of every step
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    mean_losses = (lt / n).tolist()
    mt = torch.tensor([float(max(mem) if mem else 0)])
    dist.all_reduce(mt, op=dist.ReduceOp.MAX)
    k = min(args.check_steps, len(steps_run))
    check: dict[str, Any] = {"steps": k, "approximate": peer.approximate}
    if rank == 0 and k:
        ref = reference_losses(args, n, steps_run[:k])
        diff = max(abs(x - y) for x, y in zip(mean_losses[:k], ref))
        tol = (APPROX_RTOL if peer.approximate else RTOL) * max(1.0, max(abs(x) for x in ref))
        check.update(max_abs_diff=diff, tol=tol, ok=diff <= tol, losses=mean_losses[:k], reference=ref)
        verdict = "ok" if check["ok"] else "FAILED"
        print(f"[peers] {args.peer}: check against one process over {k} steps (A = {steps_run[:k]}): max |loss - "
              f"one process's| = {diff:.3g} (tol {tol:.1g}{', approximate by design' if peer.approximate else ''}): "
              f"{verdict}", flush=True)
        for s, (x, y) in enumerate(zip(mean_losses[:k], ref)):
            print(f"[peers]   step {s}: {x:.8f} vs {y:.8f}", flush=True)
    rows = []
    for accum in accums:
        row: dict[str, Any] = {"name": args.peer, "kind": "baseline", "peer": peer.release, "accum": accum,
                               "error": None, "state_bytes": mt.item(), "patches": sorted(active),
                               "approximate": peer.approximate or any(P.PATCHES[a].approximate for a in active),
                               "check": check}
        t = statistics.median(times[accum])
        row.update(step_s=t, tokens_per_s=n * accum * args.batch * args.seq / t, times=times[accum])
        if on_emulator and rank == 0:
            per = [{key: v / m for key, v in s.items()} for s in sent[accum]]
            row["intra_bytes"] = statistics.median(p.get("lo", 0) for p in per)
            row["inter_bytes"] = statistics.median(sum(v for key, v in p.items() if key != "lo") for p in per)
            per_link = m if os.environ.get("PARO_EMU_TOPOLOGY") == "shared" else 1
            row["link_s"] = row["inter_bytes"] * per_link / (parse_rate(os.environ["PARO_EMU_RATE"]) / 8)
        if unshaped.get(accum):
            row["unshaped_s"] = statistics.median(unshaped[accum])
        rows.append(row)
    if rank == 0:
        for r in rows:
            print(f"[peers] {peer.label} ({peer.release}, patches: {','.join(r['patches']) or 'none'}) A = "
                  f"{r['accum']}: step {r['step_s']:.3f} s, state {r['state_bytes'] / 2**20:.2f} MiB/rank", flush=True)
        print(RESULT_TAG + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(parse())
