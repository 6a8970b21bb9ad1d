"""The headline benchmark: every named PaRO strategy and the advisor's pick against FSDP2 ZeRO-3,
FSDP2 HSDP, FSDP2 ``reshard_after_forward=m`` (ZeRO++ hpZ-like) and torch DDP, on the emulated
cluster (``tools.emulate``), A = 1 and A = 4.

    python -m tools.bench                       # 2 nodes x 2 ranks, 200mbit, shared uplink (root)
    python -m tools.bench --quick               # fewer rounds, A = 1 only: about a minute
    python -m tools.bench --trainable 0.0625    # partial training: ~1/16 of the weights trainable
    python -m tools.bench --dtype bf16          # bf16 parameters and gradients (fp32 master / states)
    python -m tools.emulate -- -m tools.bench   # the same worker through the emulator CLI
    python -m tools.bench --quick --nodes 2 --ranks-per-node 4   # 8 ranks: about 2 minutes here
    make bench                                  # the README's headline: A = 1 and 4, then 1/16 trainable
    python -m tools.bench --model mlp --dim 512 --ffn 2048 --layers 4 --inter-rate 1gbit --accum 4 \
        --strategies GGG,IIG,NIG,NII --baselines fsdp2-zero3,fsdp2-hsdp   # the boundary benchmark (8.4M MLP)
    python -m tools.bench --compiled            # eager vs compiled vs each graph pass vs FSDP2 + compile
                                                # (compiled_emulated.py: 1gbit, A = 2, timelines per variant)

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
rank's: ``--steps-per-round`` steps back to back from a barrier until what they left in flight
has landed (PaRO: the last step's push, which training hides under the next forward), over K;
the table shows the median. PaRO steps train the FSDP2 way, as the trainer does: torch's AdamW
over the trainable parameters, ``set_requires_gradient_sync`` on the last micro-step only (the
boundary under its backward), torch's ``clip_grad_norm_``.

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
  unsh s     the same step in the same round with every link unshaped (tools.emulate's
             set_link_rate): the compute-side limit (--no-limit skips it)
  link s     a node's inter bytes over its link's rate: the link-side limit
  /limit     meas s over the limit, the larger of unsh s and link s
  hidden     the fraction of link s that compute hides: 1 - (meas s - unsh s) / link s, in [0, 1]
  pred s     the advisor's predicted step time with a cluster calibrated on this emulator
             (paro_fsdp.cost.calibrate.calibrate_in_process, run by the workers first); PaRO rows only
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from tools.emulate.emulator import Emulator, EmulatorError, check_privileges
from .headline_report import write_png
from .peers import driver as peers
from .headline_worker import RESULT_TAG, worker
from tools.emulate.launch import ResultTee, launch, worker_or_driver

#: the command line the driver starts on every emulated node (as ``--worker``)
CLI = "tools.bench"

STRATEGIES = ("NNN", "NNG", "NGG", "GGG", "III", "NII", "NIG", "IIG", "IGG", "ING")
BASELINES = ("fsdp2-zero3", "fsdp2-hsdp", "fsdp2-hpz", "ddp")
DTYPES = ("fp32", "bf16")


#: defaults that differ with --compiled (compiled_emulated.py): ~8M parameters, micro-batch
#: 4 x 64, A = 2, 1 Gbit/s, in 2 layers to keep each variant's cold compile short
DEFAULTS = {
    False: dict(strategies=",".join(STRATEGIES), baselines=",".join(BASELINES), accum="1,4", inter_rate="200mbit",
                dim=128, layers=4, heads=4, kv_heads=2, ffn=352, vocab=1024, seq=128, batch=2, out_dir="outputs/bench"),
    True: dict(strategies="GGG,IGG,IIG,NIG,NII", baselines="fsdp2-zero3", accum="2", inter_rate="1gbit", dim=512,
               layers=2, heads=8, kv_heads=4, ffn=1408, vocab=2048, seq=64, batch=4, out_dir="outputs/bench/compiled"),
}


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0],
                                epilog="Defaults marked * differ with --compiled: " + ", ".join(
                                    f"{k}={v}" for k, v in DEFAULTS[True].items()))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-rate", default=None, help="* (200mbit)")
    p.add_argument("--inter-delay", default="1ms")
    p.add_argument("--topology", default="shared", choices=("shared", "rails"))
    p.add_argument("--strategies", default=None, help="* (all ten named)")
    p.add_argument("--baselines", default=None, help="* (all four)")
    p.add_argument("--accum", default=None, help="* gradient accumulation steps, comma separated (1,4)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps-per-round", type=int, default=2,
                   help="steps a configuration runs back to back per round, timed together with what they "
                        "leave in flight (PaRO's last push): one push in K runs exposed")
    for flag in ("dim", "layers", "heads", "kv-heads", "ffn", "vocab", "seq", "batch"):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"* ({DEFAULTS[False][flag.replace('-', '_')]})")
    p.add_argument(
        "--model",
        default="llama",
        choices=("llama", "hf-llama", "mlp"),
        help="hf-llama: transformers' LlamaForCausalLM of the same shapes (--lora-rank: peft's LoRA on its "
        "q/k/v/o projections); mlp: residual Linear-GELU-Linear blocks of --dim x --ffn, --layers of them "
        "(workload.MLPStack); full training, fp32, no advisor",
    )
    p.add_argument("--dtype", default="fp32", choices=DTYPES,
                   help="parameter / gradient dtype (fp32 master weights and optimizer states either way)")
    p.add_argument("--trainable", type=float, default=1.0,
                   help="fraction of the weights that is trainable (partial training): the first layers "
                        "closest to it, the rest frozen (default 1: full training)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="fine-tune a LoRA adapter of this rank (peft, on every attention projection wq/wk/wv/wo; "
                        "the base frozen), the same adapter for PaRO and every baseline; 0 = off. Skips the advisor "
                        "(it models trainable whole layers only)")
    p.add_argument("--phases", action="store_true",
                   help="PaRO rows: print each phase's seconds per step (forward, backward, the last micro-step's, "
                        "clip, optimizer step) on shaped and unshaped links")
    p.add_argument("--no-advisor", action="store_true", help="skip calibration and predictions")
    p.add_argument("--no-limit", action="store_true",
                   help="skip the limit: each round again with the links unshaped (doubles the run)")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-rank model-state budget for the verdict (default: FSDP2 HSDP's)")
    p.add_argument("--budgets", default="",
                   help="PaRO's strategy=\"auto\" under memory budgets, each timed beside the single strategies: "
                        "comma separated, each 'A-B' (midway between the predicted peaks of strategies A and B), "
                        "a number of MiB per rank, or 'max' (every strategy fits); needs the advisor's calibration")
    p.add_argument("--out-dir", default=None, help="* where bench.json and the PNGs go (outputs/bench)")
    p.add_argument("--quick", action="store_true",
                   help="A = 1 only, 2 rounds (--compiled: GGG and IIG unless --strategies, no warm-up, 2 rounds)")
    p.add_argument("--timeout", type=float, default=3600)
    c = p.add_argument_group("compiled variants (--compiled: compiled_emulated.py)")
    c.add_argument("--compiled", action="store_true",
                   help="per strategy eager, compiled, compiled + each pass alone, compiled + all passes; FSDP2 "
                        "eager and + per-block compile; first-step s, recompiles, inter bytes, timeline PNGs")
    c.add_argument("--variants", default="eager,compiled,bucketing,reorder,all",
                   help="which PaRO variants (eager, compiled, bucketing, reorder, all)")
    c.add_argument("--backend", default="inductor", choices=("inductor", "aot"),
                   help="aot: the passes on AOTAutograd's graphs without inductor codegen (seconds to compile: "
                        "a smoke, not a measurement)")
    c.add_argument("--no-timeline", action="store_true", help="no profiled step, no timeline PNGs")
    c.add_argument("--compile-cache", default=None,
                   help="inductor cache folder (per-rank subfolders); default a fresh temporary one, so the first "
                        "steps compile cold; run twice with the same folder for warm first steps")
    args = p.parse_args(argv)
    given = {k for k, v in vars(args).items() if v is not None}
    for k, v in DEFAULTS[args.compiled].items():
        if k not in given:
            setattr(args, k, v)
    if not 0 < args.trainable <= 1:
        p.error(f"--trainable must be in (0, 1], got {args.trainable}")
    if args.lora_rank < 0 or (args.lora_rank and (args.trainable != 1.0 or args.compiled)):
        p.error(f"--lora-rank {args.lora_rank} is invalid; valid: 0 (off) or a positive rank, without --trainable "
                f"and --compiled")
    if args.budgets and (args.model == "mlp" or args.compiled):
        p.error("--budgets plans Llama models (with or without --lora-rank) in eager runs: drop --model mlp / "
                "--compiled")
    if args.model == "hf-llama" and (args.compiled or args.trainable != 1.0):
        p.error("--model hf-llama measures eager full training or LoRA (no --compiled, --trainable)")
    if args.lora_rank:
        args.no_advisor = True
    if args.model == "mlp":
        if args.trainable != 1.0 or args.lora_rank or args.compiled or args.dtype != "fp32":
            p.error("--model mlp measures fp32 full training (no --trainable, --lora-rank, --compiled, --dtype)")
        args.no_advisor = True
    if args.compiled:
        from .compiled_emulated_report import MODES

        bad = [b for b in filter(None, args.baselines.split(",")) if not b.startswith("fsdp2-")]
        if bad or "," in args.accum or set(filter(None, args.variants.split(","))) - set(MODES):
            p.error(f"--compiled takes one --accum, --variants from {','.join(MODES)} and FSDP2 baselines only")
        if args.dtype != "fp32" or args.trainable != 1.0:
            p.error("--compiled measures fp32 full training (no --dtype / --trainable)")
        if args.quick:
            args.warmup, args.rounds = 0, min(args.rounds, 2)
            if "strategies" not in given:
                args.strategies = "GGG,IIG"
    elif args.quick:
        args.accum, args.rounds = "1", 2
    peers.bench_args(p, args)  # the peers (tools/bench/peers) leave args.baselines for args.peers
    return args


# ---- driver ---------------------------------------------------------------------------------------
def driver(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        check_privileges()
    except EmulatorError as e:
        print(f"[bench] error: {e}", file=sys.stderr)
        return 2
    drop = {"--nodes", "--inter-rate", "--inter-delay", "--topology", "--out-dir", "--timeout", "--compile-cache"}
    worker_argv, skip = [], False
    for a in argv:  # the worker gets the model / run flags; the network ones are the driver's
        if skip:
            skip = False
            continue
        if a.split("=")[0] in drop:
            skip = "=" not in a
            continue
        worker_argv.append(a)
    os.makedirs(args.out_dir, exist_ok=True)
    env = {}
    if args.compiled:  # rank 0 writes the timeline PNGs; every first step compiles cold unless a cache is given
        worker_argv += ["--out-dir", os.path.abspath(args.out_dir)]
        cache = args.compile_cache or tempfile.mkdtemp(prefix="paro-bench-inductor-")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache)
    tee = ResultTee(RESULT_TAG)
    try:
        with Emulator(args.nodes, args.ranks_per_node, args.inter_rate, args.inter_delay, args.topology) as emu:
            rc = launch(emu, ["-m", CLI, "--worker", *worker_argv], timeout=args.timeout, out=tee,  # type: ignore[arg-type]
                        extra_env=env)
            peer_rows = peers.bench_run(emu, args) if rc == 0 else []  # each peer in its venv, same cluster
    finally:
        if args.compiled and not args.compile_cache:
            shutil.rmtree(env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    if rc != 0:
        return rc
    for payload in tee.tagged():
        res = json.loads(payload)
        peers.bench_merge(res, peer_rows, args.budget_mib)
        with open(os.path.join(args.out_dir, "bench.json"), "w") as f:
            json.dump(res, f, indent=1)
        if args.compiled:
            pngs = [r["timeline"]["png"] for r in res["rows"] if (r.get("timeline") or {}).get("png")]
            print(f"\nwrote {args.out_dir}/bench.json and {len(pngs)} timeline PNGs there")
            continue
        png = write_png(res["rows"], res["meta"], os.path.join(args.out_dir, "throughput_vs_memory.png"))
        print(f"\nwrote {args.out_dir}/bench.json" + (f" and {png}" if png else " (no matplotlib: no PNG)"))
    return 0


def _worker(args: argparse.Namespace) -> None:
    if args.compiled:
        from .compiled_emulated import worker as compiled_worker

        compiled_worker(args)
    else:
        worker(args)


def main(argv: list[str] | None = None) -> int:
    return worker_or_driver(argv, _args, _worker, driver)
