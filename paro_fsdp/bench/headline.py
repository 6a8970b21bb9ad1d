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

import argparse
import json
import os
import sys

from .emulator import Emulator, EmulatorError, check_privileges
from .headline_report import write_png
from .headline_worker import RESULT_TAG, worker
from .launch import ResultTee, launch, worker_or_driver

#: the command line the driver starts on every emulated node (as ``--worker``)
CLI = "tools.bench"

STRATEGIES = ("NNN", "NNG", "NGG", "GGG", "III", "NII", "NIG", "IIG", "IGG", "ING")
BASELINES = ("fsdp2-zero3", "fsdp2-hsdp", "fsdp2-hpz", "ddp")
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


# ---- driver ---------------------------------------------------------------------------------------
def driver(args: argparse.Namespace, argv: list[str]) -> int:
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
    tee = ResultTee(RESULT_TAG)
    with Emulator(args.nodes, args.ranks_per_node, args.inter_rate, args.inter_delay, args.topology) as emu:
        rc = launch(emu, ["-m", CLI, "--worker", *worker_argv], timeout=args.timeout, out=tee)  # type: ignore[arg-type]
    if rc != 0:
        return rc
    for payload in tee.tagged():
        res = json.loads(payload)
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "bench.json"), "w") as f:
            json.dump(res, f, indent=1)
        png = write_png(res["rows"], res["meta"], os.path.join(args.out_dir, "throughput_vs_memory.png"))
        print(f"\nwrote {args.out_dir}/bench.json" + (f" and {png}" if png else " (no matplotlib: no PNG)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    return worker_or_driver(argv, _args, worker, driver)


