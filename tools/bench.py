"""The headline benchmark: every named PaRO strategy and the advisor's pick against FSDP2 ZeRO-3,
FSDP2 HSDP, FSDP2 ``reshard_after_forward=m`` (ZeRO++ hpZ-like) and torch DDP, on the emulated
cluster (tools/emulate.py), A = 1 and A = 4.

    python -m tools.bench                       # 2 nodes x 2 ranks, 200mbit, shared uplink (root)
    python -m tools.bench --quick               # fewer rounds, A = 1 only: about a minute
    python -m tools.bench --trainable 0.0625    # partial training: ~1/16 of the weights trainable
    python -m tools.bench --dtype bf16          # bf16 parameters and gradients (fp32 master / states)
    python -m tools.emulate -- -m tools.bench   # the same worker through the emulator CLI
    python -m tools.bench --quick --nodes 2 --ranks-per-node 4   # 8 ranks: about 2 minutes here
    make bench                                  # the README's headline: A = 1 and 4, then 1/16 trainable

Why: PaRO's claims are relative to what users would run instead, on the same network. Every
configuration trains the same Llama (same init, same data) with AdamW, clip 1.0, the blocks
wrapped one by one as FSDP2 does, in the same dtype: fp32, or with ``--dtype bf16`` bf16
parameters, compute and gradient communication with fp32 master weights and AdamW states
(PaRO: ``MixedPrecision(param_dtype=bf16)``; FSDP2: ``MixedPrecisionPolicy(bf16, bf16)``; DDP:
bf16 autocast and the bf16 gradient-compression hook).

Partial training (``--trainable F``, the paper's Psi' < Psi and its ING case): the first t layers
are trainable, t >= 1 the count closest to F x Psi, and everything else, the root (embeddings,
final norm, output) included, is frozen (requires_grad=False), the convention of
``tools.estimate`` and the advisor, so the advisor predicts the same model. Frozen weights have
no gradient and no optimizer state in every configuration. Every model lives at once and the rounds interleave
them (order flipped every round) so machine noise hits all alike; a step's time is the slowest
rank's, from a barrier to the end of ``optimizer.step``; the table shows the median.

Columns:
  tok/s      tokens per second over all ranks (n x A x micro-batch x seq / step time)
  vs Z3      throughput relative to FSDP2 ZeRO-3 with the same A
  state MiB  per-rank model states: P + G + OS as held between backward and step (PaRO: the
             engine's memory_report, P and G in their dtype, OS = fp32 master + AdamW's two
             moments, the spec's K = 12 bytes; baselines: the local shards of their parameters
             (fp32: they are the master), of the gradients of trainable ones (fp32) and AdamW's
             states). In fp32 PaRO holds the master beside P (4 bytes per element more than a
             baseline at the same level); in bf16 both hold 16 bytes per trainable element.
  intra/inter MiB  bytes one rank sends per step inside / between nodes, *measured*: the kernel's
             tx_bytes counters of node 0's loopback (intra) and uplink(s) (inter), divided by
             the ranks per node (gloo's wire bytes: its reduce-scatter is an all-reduce)
  pred s     the advisor's predicted step time with a cluster calibrated on this emulator
             (paro_fsdp.cost.calibrate.calibrate_in_process, run by the workers first); PaRO rows only
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Callable  # noqa: E402

from tools.emulate import local_tx_bytes  # noqa: E402

RESULT_TAG = "PARO_BENCH_JSON "
STRATEGIES = ("NNN", "NNG", "NGG", "GGG", "III", "NII", "NIG", "IIG", "IGG", "ING")
BASELINES = ("fsdp2-zero3", "fsdp2-hsdp", "fsdp2-hpz", "ddp")
BASELINE_LABEL = {"fsdp2-zero3": "FSDP2 ZeRO-3", "fsdp2-hsdp": "FSDP2 HSDP", "fsdp2-hpz": "FSDP2 raf=m (hpZ)",
                  "ddp": "torch DDP"}
LR, WD, MAX_NORM = 1e-3, 0.1, 1.0
DTYPES = ("fp32", "bf16")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-rate", default="200mbit")
    p.add_argument("--inter-delay", default="1ms")
    p.add_argument("--topology", default="shared", choices=("shared", "rails"))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--baselines", default=",".join(BASELINES))
    p.add_argument("--accum", default="1,4", help="gradient accumulation steps, comma separated")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=352)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=DTYPES,
                   help="parameter / gradient dtype (fp32 master weights and optimizer states either way)")
    p.add_argument("--trainable", type=float, default=1.0,
                   help="fraction of the weights that is trainable (partial training): the first layers "
                        "closest to it, the rest frozen (default 1: full training)")
    p.add_argument("--no-advisor", action="store_true", help="skip calibration and predictions")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-rank model-state budget for the verdict (default: FSDP2 HSDP's)")
    p.add_argument("--out-dir", default="outputs/bench", help="where the driver writes bench.json and the PNG")
    p.add_argument("--quick", action="store_true", help="A = 1 only, 2 rounds")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    if not 0 < args.trainable <= 1:
        p.error(f"--trainable must be in (0, 1], got {args.trainable}")
    if args.quick:
        args.accum, args.rounds = "1", 2
    return args


# ---- worker ---------------------------------------------------------------------------------------
@dataclass
class Runner:
    name: str
    kind: str  # "paro" or "baseline"
    step_fn: Callable[[int, int], Any]  # (step index, accum) -> loss
    memory_fn: Callable[[], int]
    times: dict[int, list[float]] = field(default_factory=dict)
    sent: dict[int, list[dict[str, int]]] = field(default_factory=dict)
    n_steps: int = 0
    error: str | None = None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from paro_fsdp import MixedPrecision, ParoOptimizer, init_paro_mesh, paro_shard
    from paro_fsdp.cost.model import model_spec
    from paro_fsdp.models.llama import Llama, LlamaArgs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    m = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks_per_node))
    mesh = init_paro_mesh(m)
    margs = LlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      vocab_size=args.vocab, ffn_dim=args.ffn, max_seq_len=args.seq)
    accums = [int(a) for a in args.accum.split(",")]
    uplinks = sorted(set(filter(None, os.environ.get("PARO_EMU_IFNAMES", "").split(","))))
    on_emulator = bool(uplinks)

    bf16 = args.dtype == "bf16"
    # partial training: the first t layers trainable, the rest and the root frozen (advisor's rule)
    n_trainable = model_spec(margs, args.trainable).trainable_layers

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        model = Llama(margs)
        if n_trainable < margs.n_layers:
            for name, p in model.named_parameters():
                if not (name.startswith("layers.") and int(name.split(".")[1]) < n_trainable):
                    p.requires_grad_(False)
        return model

    def trainable(model: torch.nn.Module) -> list:
        return [p for p in model.parameters() if p.requires_grad]

    def batch(i: int, a: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(10_000 * i + 100 * a + rank)
        return torch.randint(0, margs.vocab_size, (args.batch, args.seq + 1), generator=gen)

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    def _baseline_memory(model: Any, opt: Any) -> int:
        """Model-state bytes of a baseline: P, G (same layout and dtype as the trainable P) and
        the optimizer's states."""
        p = sum(local_bytes(x) for x in model.parameters())
        g = sum(local_bytes(x) for x in model.parameters() if x.requires_grad)
        os_ = sum(local_bytes(t) for st in opt.state.values() for t in st.values()
                  if torch.is_tensor(t) and t.dim() > 0)
        return p + g + os_

    # ---- builders ----
    def paro(strategy: str) -> Runner:
        mp = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
        model = paro_shard(make_model(), mesh, strategy, mp=mp)
        opt = ParoOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, foreach=True)

        def step(i: int, accum: int):
            total = 0.0
            for a in range(accum):
                loss = model(batch(i, a)).loss / accum
                loss.backward()
                total += loss.item()
            opt.clip_grad_norm_(MAX_NORM)
            opt.step()
            opt.zero_grad()
            return total

        return Runner(strategy, "paro", step, lambda: model.memory_report(opt)["total"])

    def fsdp2(kind: str) -> Runner:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = make_model()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
            else MixedPrecisionPolicy()
        if kind == "fsdp2-hsdp":
            fmesh, raf = init_device_mesh("cpu", (n // m, m), mesh_dim_names=("dp_replicate", "dp_shard")), True
        else:
            fmesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
            raf = m if kind == "fsdp2-hpz" else True  # hpZ-like: after forward keep a copy sharded over m
        for layer in model.layers:
            fully_shard(layer, mesh=fmesh, reshard_after_forward=raf, mp_policy=mp)
        fully_shard(model, mesh=fmesh, reshard_after_forward=True, mp_policy=mp)
        opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WD, foreach=True)
        hsdp = kind == "fsdp2-hsdp"

        def step(i: int, accum: int):
            total = 0.0
            for a in range(accum):
                if hsdp:  # FSDP2's accumulation idiom: the inter all-reduce only on the last micro-step
                    model.set_requires_all_reduce(a == accum - 1)
                loss = model(batch(i, a)).loss / accum
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(trainable(model), MAX_NORM)
            opt.step()
            opt.zero_grad()
            return total

        return Runner(kind, "baseline", step, lambda: _baseline_memory(model, opt))

    def ddp() -> Runner:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(make_model())
        if bf16:  # bf16 compute (autocast) and bf16 gradient all-reduce; fp32 weights are the master
            model.register_comm_hook(None, _bf16_allreduce_hook)
        opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WD, foreach=True)

        def step(i: int, accum: int):
            total = 0.0
            for a in range(accum):
                ctx = model.no_sync() if a < accum - 1 else _null()
                with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = model(batch(i, a)).loss / accum
                    loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(trainable(model), MAX_NORM)
            opt.step()
            opt.zero_grad()
            return total

        # (DDP's reducer buckets hold one more gradient copy, not counted)
        return Runner("ddp", "baseline", step, lambda: _baseline_memory(model, opt))

    # ---- advisor ----
    cluster, preds, pick = None, {}, None
    t0 = time.perf_counter()
    if not args.no_advisor:
        from paro_fsdp.cost.calibrate import calibrate_in_process
        from paro_fsdp.cost.predict import choose_strategy, predict

        cluster = calibrate_in_process(mesh, margs, micro_batch=args.batch, seq_len=args.seq, dtype=args.dtype, reps=2,
                                       name="emulated")
        for a in accums:
            for s in args.strategies.split(","):
                preds[(s, a)] = predict(margs, s, n, m, args.batch, a, args.seq, cluster, dtype=args.dtype,
                                        trainable_fraction=args.trainable).step_time
            best, _ = choose_strategy(margs, n, m, args.batch, a, args.seq, args.dtype, cluster,
                                      trainable_fraction=args.trainable, strategies=args.strategies.split(","))
            pick = pick or {}
            pick[a] = best.name
    t_cal = time.perf_counter() - t0

    runners: list[Runner] = []
    for s in args.strategies.split(","):
        runners.append(paro(s))
    for b in filter(None, args.baselines.split(",")):
        try:
            runners.append(ddp() if b == "ddp" else fsdp2(b))
        except Exception as e:  # noqa: BLE001 - a baseline this torch cannot build is reported, not fatal
            runners.append(Runner(b, "baseline", lambda i, a: 0.0, lambda: 0, error=f"{type(e).__name__}: {e}"))

    def timed(r: Runner, accum: int) -> tuple[float, dict[str, int]]:
        # counters before the barrier: after it node 0's other ranks may send before rank 0 reads
        before = local_tx_bytes(["lo", *uplinks]) if rank == 0 and on_emulator else {}
        dist.barrier()
        t = time.perf_counter()
        r.step_fn(r.n_steps, accum)
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        after = local_tx_bytes(["lo", *uplinks]) if rank == 0 and on_emulator else {}
        r.n_steps += 1
        return dt.item(), {k: after[k] - before[k] for k in after}

    t0 = time.perf_counter()
    for accum in accums:
        for rnd in range(args.warmup + args.rounds):
            order = runners if rnd % 2 == 0 else runners[::-1]
            for r in order:
                if r.error:
                    continue
                t, sent = timed(r, accum)
                if rnd >= args.warmup:
                    r.times.setdefault(accum, []).append(t)
                    r.sent.setdefault(accum, []).append(sent)
    t_run = time.perf_counter() - t0

    rows = []
    for r in runners:
        mem = torch.tensor([float(r.memory_fn()) if not r.error else 0.0])
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        for accum in accums:
            row: dict[str, Any] = {"name": r.name, "kind": r.kind, "accum": accum, "error": r.error,
                                   "state_bytes": mem.item()}
            if not r.error:
                t = statistics.median(r.times[accum])
                row.update(step_s=t, tokens_per_s=n * accum * args.batch * args.seq / t, times=r.times[accum])
                if on_emulator and rank == 0:
                    per = [{k: v / m for k, v in s.items()} for s in r.sent[accum]]
                    row["intra_bytes"] = statistics.median(p.get("lo", 0) for p in per)
                    row["inter_bytes"] = statistics.median(sum(v for k, v in p.items() if k != "lo") for p in per)
                if (r.name, accum) in preds:
                    row["pred_s"] = preds[(r.name, accum)]
                if pick and pick.get(accum) == r.name:
                    row["advisor_pick"] = True
            rows.append(row)
    if rank == 0:
        ref = make_model()
        meta = {"n": n, "m": m, "topology": os.environ.get("PARO_EMU_TOPOLOGY", "none"),
                "rate": os.environ.get("PARO_EMU_RATE", "?"), "params": sum(p.numel() for p in ref.parameters()),
                "trainable_params": sum(p.numel() for p in trainable(ref)), "dtype": args.dtype,
                "model": vars(args) | {}, "calibrate_s": t_cal, "run_s": t_run,
                "cluster": None if cluster is None else {"intra_gbs": cluster.intra.bandwidth_gbs,
                                                          "inter_gbs": cluster.inter.bandwidth_gbs,
                                                          "tflops": cluster.achieved_tflops}}
        print(format_report(rows, meta, args.budget_mib), flush=True)
        print(RESULT_TAG + json.dumps({"meta": meta, "rows": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _bf16_allreduce_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """DDP comm hook: average a bucket in bf16 (torch's bf16_compress_hook insists on NCCL)."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(low, async_op=True).get_future()

    def back(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- report -------------------------------------------------------------------------------------
def _label(row: dict) -> str:
    if row["kind"] == "paro":
        return f"PaRO {row['name']}" + (" *advisor*" if row.get("advisor_pick") else "")
    return BASELINE_LABEL.get(row["name"], row["name"])


def _kendall(a: list[float], b: list[float]) -> float:
    """Kendall's tau between two score lists (1 = same order)."""
    num = den = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            s = (a[i] - a[j]) * (b[i] - b[j])
            num += (s > 0) - (s < 0)
            den += 1
    return num / den if den else float("nan")


def _trainable_note(meta: dict) -> str:
    t, p = meta.get("trainable_params", meta["params"]), meta["params"]
    return "" if t == p else f" ({t / 1e6:.3f}M = {t / p:.1%} trainable)"


def format_report(rows: list[dict], meta: dict, budget_mib: float | None) -> str:
    mib = 2**20
    out = [f"\n== tools.bench: {meta['n']} ranks = {meta['n'] // meta['m']} nodes x {meta['m']}, topology "
           f"{meta['topology']}, {meta['rate']} per link, Llama {meta['params'] / 1e6:.2f}M params"
           f"{_trainable_note(meta)}, {meta.get('dtype', 'fp32')}"]
    head = (f"{'config':<24} {'A':>2} {'tok/s':>8} {'vs Z3':>6} {'state MiB':>9} {'intra MiB':>9} "
            f"{'inter MiB':>9} {'meas s':>7} {'pred s':>7}")
    for accum in sorted({r["accum"] for r in rows}):
        sub = [r for r in rows if r["accum"] == accum]
        z3 = next((r for r in sub if r["name"] == "fsdp2-zero3" and not r["error"]), None)
        out += ["", head, "-" * len(head)]
        for r in sorted(sub, key=lambda r: -(r.get("tokens_per_s") or 0)):
            if r["error"]:
                out.append(f"{_label(r):<24} {accum:>2} failed: {r['error'][:80]}")
                continue
            vs = f"{r['tokens_per_s'] / z3['tokens_per_s']:6.2f}" if z3 else "     -"
            intra = f"{r['intra_bytes'] / mib:9.2f}" if "intra_bytes" in r else "        -"
            inter = f"{r['inter_bytes'] / mib:9.2f}" if "inter_bytes" in r else "        -"
            pred = f"{r['pred_s']:7.3f}" if "pred_s" in r else "      -"
            out.append(f"{_label(r):<24} {accum:>2} {r['tokens_per_s']:8.0f} {vs} {r['state_bytes'] / mib:9.2f} "
                       f"{intra} {inter} {r['step_s']:7.3f} {pred}")
        # the verdicts the issue asks for
        ok = [r for r in sub if not r["error"]]
        hsdp = next((r for r in ok if r["name"] == "fsdp2-hsdp"), None)
        budget = budget_mib * mib if budget_mib else (hsdp["state_bytes"] if hsdp else None)
        if budget:
            fit_p = [r for r in ok if r["kind"] == "paro" and r["state_bytes"] <= budget * 1.0001]
            fit_b = [r for r in ok if r["kind"] == "baseline" and r["state_bytes"] <= budget * 1.0001]
            if fit_p and fit_b:
                bp = max(fit_p, key=lambda r: r["tokens_per_s"])
                bb = max(fit_b, key=lambda r: r["tokens_per_s"])
                verdict = "beats" if bp["tokens_per_s"] > bb["tokens_per_s"] else "does NOT beat"
                out.append(f"budget {budget / mib:.2f} MiB/rank: best PaRO {bp['name']} ({bp['tokens_per_s']:.0f} tok/s) "
                           f"{verdict} best baseline {_label(bb)} ({bb['tokens_per_s']:.0f} tok/s): "
                           f"{bp['tokens_per_s'] / bb['tokens_per_s']:.2f}x")
        for pn, bn in (("GGG", "fsdp2-zero3"), ("III", "fsdp2-hsdp")):
            p = next((r for r in ok if r["kind"] == "paro" and r["name"] == pn), None)
            b = next((r for r in ok if r["name"] == bn), None)
            if p and b:
                ratio = p["step_s"] / b["step_s"]
                out.append(f"PaRO {pn} step time / {_label(b)}: {ratio:.2f}x "
                           f"({'within' if ratio <= 1.10 else 'OUTSIDE'} the 1.10x target)")
        pr = [r for r in ok if r["kind"] == "paro" and "pred_s" in r]
        if len(pr) >= 2:
            tau = _kendall([r["pred_s"] for r in pr], [r["step_s"] for r in pr])
            best_pred = min(pr, key=lambda r: r["pred_s"])["name"]
            best_meas = min(pr, key=lambda r: r["step_s"])["name"]
            out.append(f"advisor ranking vs measured (PaRO strategies): Kendall tau {tau:.2f}; predicted best "
                       f"{best_pred}, measured best {best_meas}")
    return "\n".join(out)


def write_png(rows: list[dict], meta: dict, path: str) -> str | None:
    """Throughput vs per-rank model-state memory, one panel per A."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    accums = sorted({r["accum"] for r in rows})
    fig, axes = plt.subplots(1, len(accums), figsize=(6.5 * len(accums), 5), squeeze=False)
    for ax, accum in zip(axes[0], accums):
        for r in rows:
            if r["accum"] != accum or r["error"]:
                continue
            paro = r["kind"] == "paro"
            ax.scatter(r["state_bytes"] / 2**20, r["tokens_per_s"], marker="o" if paro else "s",
                       color="tab:blue" if paro else "tab:red", s=60 if r.get("advisor_pick") else 30)
            ax.annotate(_label(r).replace("PaRO ", ""), (r["state_bytes"] / 2**20, r["tokens_per_s"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("model states per rank (MiB)")
        ax.set_ylabel("tokens / s (all ranks)")
        ax.set_title(f"A = {accum}: PaRO (blue) vs baselines (red)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{meta['n'] // meta['m']} nodes x {meta['m']} ranks, {meta['topology']}, {meta['rate']}, "
                 f"{meta.get('dtype', 'fp32')}{_trainable_note(meta)}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


# ---- driver ---------------------------------------------------------------------------------------
class _Tee(io.RawIOBase):
    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, b) -> int:  # type: ignore[override]
        self.buf += b
        if not bytes(b).startswith(RESULT_TAG.encode()):
            sys.stdout.buffer.write(b)
            sys.stdout.buffer.flush()
        return len(b)


def driver(args: argparse.Namespace, argv: list[str]) -> int:
    from tools.emulate import Emulator, EmulatorError, check_privileges, launch

    try:
        check_privileges()
    except EmulatorError as e:
        print(f"[bench] error: {e}", file=sys.stderr)
        return 2
    drop = {"--nodes", "--inter-rate", "--inter-delay", "--topology", "--out-dir", "--timeout"}
    worker_argv, skip = [], False
    for a in argv:  # the worker gets the model / run flags; the network ones are the driver's
        if skip:
            skip = False
            continue
        if a.split("=")[0] in drop:
            skip = "=" not in a
            continue
        worker_argv.append(a)
    tee = _Tee()
    with Emulator(args.nodes, args.ranks_per_node, args.inter_rate, args.inter_delay, args.topology) as emu:
        rc = launch(emu, ["-m", "tools.bench", "--worker", *worker_argv], timeout=args.timeout, out=tee)  # type: ignore[arg-type]
    if rc != 0:
        return rc
    for line in tee.buf.decode(errors="replace").splitlines():
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, "bench.json"), "w") as f:
                json.dump(res, f, indent=1)
            png = write_png(res["rows"], res["meta"], os.path.join(args.out_dir, "throughput_vs_memory.png"))
            print(f"\nwrote {args.out_dir}/bench.json" + (f" and {png}" if png else " (no matplotlib: no PNG)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    is_worker = "--worker" in argv
    if is_worker:
        argv.remove("--worker")
    args = _args(argv)
    if is_worker or "RANK" in os.environ:
        worker(args)
        return 0
    return driver(args, argv)


if __name__ == "__main__":
    sys.exit(main())
