"""The per-rank side of ``headline.py`` (under torchrun on every emulated node): builds every PaRO
strategy and baseline at once, calibrates the advisor on the emulated mesh, runs the interleaved
rounds, measures step times, tx bytes and model-state memory, and prints the report (rank 0) and
one machine-readable result line for the driver.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tools.emulate.emulator import UNSHAPED, local_tx_bytes, parse_rate, set_link_rate
from tools.emulate.gloo_rs import install_from_env
from .headline_report import format_report
from .workload import LR, MAX_NORM, WD, MLPStack

RESULT_TAG = "PARO_BENCH_JSON "


class PhaseClock:
    """``--phases``: wall seconds between laps, summed per phase name into ``into`` (None: off)."""

    def __init__(self, into: dict[str, list[float]] | None) -> None:
        self.into, self.t = into, time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.into is None:
            return
        now = time.perf_counter()
        self.into.setdefault(phase, []).append(now - self.t)
        self.t = now


def print_phases(phases: dict[tuple[str, bool], dict[str, list[float]]], steps: int, rank: int) -> None:
    """Where a PaRO step's time goes, shaped against unshaped links: each phase's seconds per step
    (summed over its micro-steps), the mean over ranks; the settle (the last push) is outside."""
    import torch
    import torch.distributed as dist

    for name in sorted({k[0] for k in phases}):
        rows = {}
        for shaped in (True, False):
            got = phases.get((name, shaped), {})
            names = sorted(got)
            n_steps = max(1, len(got.get("optimizer.step", [])))
            t = torch.tensor([sum(got[p]) / n_steps for p in names], dtype=torch.float64)
            dist.all_reduce(t)
            rows[shaped] = dict(zip(names, (t / dist.get_world_size()).tolist()))
        if rank == 0:
            print(f"\n-- {name}: seconds per step by phase (mean over ranks)\n"
                  f"{'phase':<18} {'shaped':>8} {'unshaped':>8} {'extra':>8}")
            for p in rows[True]:
                u = rows[False].get(p, float("nan"))
                print(f"{p:<18} {rows[True][p]:8.4f} {u:8.4f} {rows[True][p] - u:+8.4f}")


# ---- worker ---------------------------------------------------------------------------------------
@dataclass
class Runner:
    name: str
    kind: str  # "paro" or "baseline"
    step_fn: Callable[[int, int], Any]  # (step index, accum) -> loss
    memory_fn: Callable[[], int]
    settle: Callable[[], None] = lambda: None  # what a step leaves in flight, landed (PaRO: the pushes)
    times: dict[int, list[float]] = field(default_factory=dict)
    unshaped: dict[int, list[float]] = field(default_factory=dict)  # the same steps, links unshaped
    sent: dict[int, list[dict[str, int]]] = field(default_factory=dict)
    n_steps: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # what the report reads beside the times (auto's plan)


def wired(strategy: str) -> tuple[str, str | None]:
    """``"GGG+int8"`` -> ("GGG", "int8"): a strategy and its quantized inter wire (None: exact)."""
    name, _, wire = strategy.partition("+")
    return name, wire or None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
    from paro_fsdp.cost.model import model_spec
    from paro_fsdp.models.llama import Llama, LlamaArgs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gloo_rs = install_from_env()
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
    n_trainable = model_spec(margs, args.trainable).trainable_layers if args.model != "mlp" else margs.n_layers

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        if args.model == "hf-llama":
            return hf_causal_lm(margs, args.lora_rank)
        model = Llama(margs) if args.model == "llama" else MLPStack(args.dim, args.ffn, args.layers, args.vocab)
        if args.lora_rank:  # the same adapter for every variant: LoRA on the attention projections, base frozen
            from peft import LoraConfig, inject_adapter_in_model

            model = inject_adapter_in_model(LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                       target_modules=["wq", "wk", "wv", "wo"]), model)
            for name, p in model.named_parameters():
                p.requires_grad_("lora_" in name)
        elif n_trainable < margs.n_layers:
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

    phases: dict[tuple[str, bool], dict[str, list[float]]] = {}  # --phases: (runner, shaped) -> phase -> s
    shaped = [False]

    # ---- builders ----
    def paro(strategy: str) -> Runner:
        """``"GGG"``, or ``"GGG+int8"``: its inter phases quantized (``MixedPrecision.inter_dtype``)."""
        name, wire = wired(strategy)
        mp = MixedPrecision(param_dtype=torch.bfloat16 if bf16 else torch.float32, inter_dtype=wire)
        model = paro_shard(make_model(), mesh, name, mp=mp)
        opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WD, foreach=True)  # the fp32 masters
        return paro_step(strategy, model, opt)

    def paro_step(name: str, model: Any, opt: Any) -> Runner:
        def step(i: int, accum: int):
            clock = PhaseClock(phases.setdefault((name, shaped[0]), {}) if args.phases else None)
            total = 0.0
            for a in range(accum):
                last = a == accum - 1
                model.set_requires_gradient_sync(last)  # the boundary under the last backward
                loss = model(batch(i, a)).loss / accum
                clock.lap("forward, last" if last else "forward, first" if a == 0 else "forward")
                loss.backward()
                clock.lap("backward, last" if last else "backward")
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(trainable(model), MAX_NORM)
            clock.lap("clip_grad_norm_")
            opt.step()
            clock.lap("optimizer.step")
            opt.zero_grad()
            clock.lap("zero_grad")
            return total

        return Runner(name, "paro", step, lambda: model.memory_report(opt)["total"], model.wait_for_params)

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

    def auto(token: str) -> Runner:
        """``strategy="auto"`` under the budget ``token`` names, built through ``paro_shard`` as a user
        would (the plan printed by rank 0); the row carries the budget, the plan's predicted peak
        and the single strategies whose predicted peak fits, for the verdict."""
        from paro_fsdp.cost.budget import Workload, plan_blocks, units_of

        mp = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else MixedPrecision()
        work = Workload(micro_batch=args.batch, seq_len=args.seq, grad_accum=accums[-1], model=margs)
        model = make_model()
        itemsizes = (mp.param_dtype.itemsize, mp.grad_dtype.itemsize, mp.acc_dtype.itemsize)
        probe = plan_blocks(units_of(model, list(model.layers)), n, m, float(2**60), cluster, work, model_spec(margs),
                            *itemsizes)
        peak = {s: f for s, f, _ in probe.single}
        if token == "max":
            budget = max(peak.values())
        elif "-" in token:
            lo, hi = (peak[s.strip().upper()] for s in token.split("-"))
            budget = (lo + hi) / 2
        else:
            budget = float(token) * 2**20
        plan = plan_blocks(units_of(model, list(model.layers)), n, m, budget, cluster, work, model_spec(margs),
                           *itemsizes)
        model = paro_shard(model, mesh, "auto", mp=mp, memory_budget=budget, workload=work, cluster=cluster)
        opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WD, foreach=True)
        runner = paro_step(f"auto[{token}]", model, opt)
        runner.extra = {"budget_bytes": budget, "pred_peak": plan.footprint, "plan_pred_s": plan.step_time,
                        "plan": sorted({" ".join(s.name for s in o.label) for o in plan.options}),
                        "fits": sorted(s for s, f in peak.items() if f <= budget), "single_peak": peak,
                        "best_single": min((x for x in probe.single if x[1] <= budget), key=lambda x: x[2])[0]}
        return runner

    # ---- advisor ----
    cluster, preds, pick = None, {}, None
    t0 = time.perf_counter()
    if not args.no_advisor or args.budgets:
        from paro_fsdp.cost.calibrate import calibrate_in_process
        from paro_fsdp.cost.predict import choose_strategy, predict
        from paro_fsdp.cost.cluster import cluster_to_toml

        cluster = calibrate_in_process(mesh, margs, micro_batch=args.batch, seq_len=args.seq, dtype=args.dtype, reps=2,
                                       name="emulated")
        box = [cluster]
        dist.broadcast_object_list(box, src=0)  # one cluster, so every rank plans the same layout
        cluster = box[0]
        for a in (accums if not args.no_advisor else []):
            for s in args.strategies.split(","):
                preds[(s, a)] = predict(margs, wired(s)[0], n, m, args.batch, a, args.seq, cluster, dtype=args.dtype,
                                        trainable_fraction=args.trainable, inter_dtype=wired(s)[1]).step_time
            exact = [s for s in args.strategies.split(",") if wired(s)[1] is None]
            best, _ = choose_strategy(margs, n, m, args.batch, a, args.seq, args.dtype, cluster,
                                      trainable_fraction=args.trainable, strategies=exact or None)
            pick = pick or {}
            pick[a] = best.name
    t_cal = time.perf_counter() - t0

    runners: list[Runner] = []
    for s in args.strategies.split(","):
        runners.append(paro(s))
    for token in filter(None, args.budgets.split(",")):
        runners.append(auto(token.strip()))
    best_singles = {r.extra["best_single"] for r in runners if "best_single" in r.extra}
    for name in sorted(best_singles - {r.name for r in runners}):
        runners.append(paro(name))  # each budget's predicted-fastest single strategy, measured beside the plan
    for b in filter(None, args.baselines.split(",")):
        try:
            runners.append(ddp() if b == "ddp" else fsdp2(b))
        except Exception as e:  # noqa: BLE001 - a baseline this torch cannot build is reported, not fatal
            runners.append(Runner(b, "baseline", lambda i, a: 0.0, lambda: 0, error=f"{type(e).__name__}: {e}"))

    def timed(r: Runner, accum: int) -> tuple[float, dict[str, int]]:
        """Per step: ``--steps-per-round`` steps back to back, then what they left in flight
        landed, all in the window: PaRO's push under the next forward counts as it runs in
        training (one in K exposed), and no model's traffic leaks into the next one's window."""
        # counters before the barrier: after it node 0's other ranks may send before rank 0 reads
        before = local_tx_bytes(["lo", *uplinks]) if rank == 0 and on_emulator else {}
        dist.barrier()
        t = time.perf_counter()
        for _ in range(args.steps_per_round):
            r.step_fn(r.n_steps, accum)
            r.n_steps += 1
        r.settle()
        dt = torch.tensor([(time.perf_counter() - t) / args.steps_per_round], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        after = local_tx_bytes(["lo", *uplinks]) if rank == 0 and on_emulator else {}
        return dt.item(), {k: (after[k] - before[k]) / args.steps_per_round for k in after}

    def links(rate: str) -> None:
        shaped[0] = rate != UNSHAPED
        dist.barrier()
        if rank == 0:
            set_link_rate(rate)
        dist.barrier()

    limit = on_emulator and not args.no_limit
    shaped[0] = on_emulator

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
            if limit and rnd >= args.warmup:  # the round again on unshaped links: the compute-side limit
                links(UNSHAPED)
                for r in order:
                    if not r.error:
                        r.unshaped.setdefault(accum, []).append(timed(r, accum)[0])
                links(os.environ["PARO_EMU_RATE"])
    t_run = time.perf_counter() - t0

    rows = []
    for r in runners:
        mem = torch.tensor([float(r.memory_fn()) if not r.error else 0.0])
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        for accum in accums:
            row: dict[str, Any] = {"name": r.name, "kind": r.kind, "accum": accum, "error": r.error,
                                   "state_bytes": mem.item(), **r.extra}
            if not r.error:
                t = statistics.median(r.times[accum])
                row.update(step_s=t, tokens_per_s=n * accum * args.batch * args.seq / t, times=r.times[accum])
                if on_emulator and rank == 0:
                    per = [{k: v / m for k, v in s.items()} for s in r.sent[accum]]
                    row["intra_bytes"] = statistics.median(p.get("lo", 0) for p in per)
                    row["inter_bytes"] = statistics.median(sum(v for k, v in p.items() if k != "lo") for p in per)
                    # a node's bytes over its link's rate (the bytes limit; shared: the node's m ranks share one)
                    per_link = m if os.environ.get("PARO_EMU_TOPOLOGY") == "shared" else 1
                    row["link_s"] = row["inter_bytes"] * per_link / (parse_rate(os.environ["PARO_EMU_RATE"]) / 8)
                if r.unshaped.get(accum):
                    row["unshaped_s"] = statistics.median(r.unshaped[accum])
                if (r.name, accum) in preds:
                    row["pred_s"] = preds[(r.name, accum)]
                if pick and pick.get(accum) == r.name:
                    row["advisor_pick"] = True
            rows.append(row)
    if args.phases:
        print_phases(phases, args.steps_per_round, rank)
    if rank == 0:
        ref = make_model()
        meta = {
            "n": n,
            "m": m,
            "topology": os.environ.get("PARO_EMU_TOPOLOGY", "none"),
            "rate": os.environ.get("PARO_EMU_RATE", "?"),
            "gloo_reduce_scatter": gloo_rs,
            "params": sum(p.numel() for p in ref.parameters()),
            "trainable_params": sum(p.numel() for p in trainable(ref)),
            "dtype": args.dtype,
            "model_kind": args.model,
            "model": vars(args) | {},
            "calibrate_s": t_cal,
            "run_s": t_run,
            "cluster": None
            if cluster is None
            else {
                "intra_gbs": cluster.intra.bandwidth_gbs,
                "inter_gbs": cluster.inter.bandwidth_gbs,
                "tflops": cluster.achieved_tflops,
                "toml": cluster_to_toml(cluster),  # the whole calibration: the predictions can be recomputed
            },
        }
        print(format_report(rows, meta, args.budget_mib), flush=True)
        print(RESULT_TAG + json.dumps({"meta": meta, "rows": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def hf_causal_lm(margs: Any, lora_rank: int) -> Any:
    """transformers' LlamaForCausalLM of the bench's shapes behind the bench's call (tokens in, an
    output with ``.loss``), with peft's LoRA on the attention projections when ``lora_rank``; its
    decoder layers as ``layers`` for the FSDP2 baselines and the budget's blocks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paro_fsdp.integrations.hf import add_lora, decoder_blocks

    config = LlamaConfig(hidden_size=margs.dim, num_hidden_layers=margs.n_layers,
                         num_attention_heads=margs.n_heads, num_key_value_heads=margs.n_kv_heads,
                         intermediate_size=margs.ffn_dim, vocab_size=margs.vocab_size,
                         max_position_embeddings=margs.max_seq_len + 1, attn_implementation="sdpa")
    lm = LlamaForCausalLM(config)
    if lora_rank:
        lm = add_lora(lm, lora_rank, alpha=2 * lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        @property
        def layers(self) -> list:
            return decoder_blocks(self.lm)

        def forward(self, tokens):
            return self.lm(input_ids=tokens, labels=tokens)  # transformers shifts the labels

    return Wrapped()


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
