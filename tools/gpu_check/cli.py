"""One command that checks the CUDA + NCCL path on one GPU, in under 8 minutes on an H200.

    python -m tools.gpu_check [--out gpu_check.json] [--parts a,b,c,d,e] [--workdir outputs/gpu_check]
    python -m tools.gpu_check --dry-run        # the plan and every command it would run; no GPU needed

Why: ``torchrun --nproc-per-node 8 train.py --job.config_file train_configs/llama7b_paro.toml``
is what users run on CUDA clusters, and none of that path had run on a GPU when this was written
(the machine it was built on has no GPU). One GPU cannot show NCCL across ranks, but it can show
everything else: the trainer with NCCL, every engine buffer on the device, memory against the
engine's own accounting and throughput against FSDP2, and, with four processes sharing the GPU
over gloo and stand-in collectives, that the engine's streams order every collective. Each part
runs in its own subprocess with a timeout, so a crash or a hang in one part does not hide the
others; (a), (b), (d) and (e) run side by side (none measures time), then (c) alone. The first row
is the torch / CUDA / NCCL versions against ``paro_fsdp._compat.SUPPORTED_TORCH``. The table shows
PASS / FAIL / SKIP and what was measured; ``--out`` gets the same as JSON, and ``--workdir`` keeps
every subprocess's log.

(a) The trainer on 1 GPU: ``train.py`` with the debug Llama (``train_configs/debug_paro.toml``, IIG,
    ``--parallelism.paro_group_size 1``: a 1 x 1 mesh), as subprocesses: the CPU reference with
    ``python train.py --comm.backend gloo`` (a world of one) and the GPU runs under ``torchrun
    --standalone --nproc-per-node 1`` with ``--comm.backend nccl``. Per-step losses come from each
    run's ``metrics.jsonl`` (``--metrics.log_freq 1``); every run has ``PARO_INIT_RNG=cpu``, so the
    GPU runs start from the CPU run's exact weights. Checks: fp32 losses on NCCL equal the gloo CPU
    run's (relative 1e-4, every one of 20 steps; the data are deterministic from the seed);
    bf16 parameters and gradients train (loss falls); ``--compile.enable`` trains (losses within
    1e-3 of eager fp32); a run resumed from the step-10 checkpoint reproduces steps 11..20.
(b) Real CUDA tensors on a fake 8-rank process group as a 2 x 4 mesh (torch's ``fake`` backend: no
    data moves, so numbers are meaningless and only placement and memory are checked): all 27
    strategies shard a small Llama, run forward, backward, clip and step, and every buffer the
    engine holds (parameters' local tensors; per group every tensor attribute: P storage, gathered
    buffers, the G accumulator, the fp32 masters and their gradients; the optimizer states) is on
    CUDA. Then a LLaMA-7B-shaped 2-layer slice (dim 4096, 32 heads, ffn 11008, vocab 32000, one
    2048-token sequence, bf16) under IIG, GGG and ING: ``torch.cuda.max_memory_allocated`` over a
    training step (after a warm-up step) against the model states of ``model.memory_report(opt)``
    plus the working set, within 10%. The working set is *measured*, not estimated: the peak of an
    unsharded single-device forward/backward of the same slice and batch, with each gradient freed
    as it is produced (whole bf16 weights, which the sharded model gathers around the block it
    computes; activations; temporaries). Expected peak = P + G + OS + max(working set,
    master_grads + boundary): the boundary's temporaries exist after backward, when the
    activations are gone. (On CPU, with torch.profiler's allocation events standing in for the
    CUDA allocator, this holds to 0.92-1.01 for IIG, GGG and ING at three sizes.)
(c) Tokens/s and MFU of a ~1B Llama (dim 2048, 16 layers, 16 heads, ffn 5632, vocab 32000: 0.96B
    parameters; micro-batch 4 x 2048 tokens, bf16, fused AdamW) on one GPU (a 1-rank NCCL world):
    PaRO GGG eager and compiled (per block, ``passes.compile_model`` with the graph passes),
    FSDP2 ``fully_shard`` (bf16 ``MixedPrecisionPolicy``, per block then root) eager and compiled
    (per block). 3 warm-up steps (the first one compiles, timed apart), then 10 steps timed with
    CUDA events. MFU = tokens/s x (6 x non-embedding parameters + 12 x layers x dim x seq) / the
    GPU's dense bf16 peak (H100/H200: 989 TFLOP/s; ``--peak-tflops`` for others). All variants start
    from the same weights and data, so their first losses must agree (relative 1e-2).

(d) The stream tests, ``tests/test_gpu_streams.py`` under pytest (each test a row): four processes
    on the one GPU as a 2 x 2 mesh over gloo (NCCL refuses two ranks on one GPU), every
    ``_c10d_functional`` collective through stand-in kernels (poisoned outputs, the exact gloo
    result written at ``wait()``, in NCCL's stream order behind a sleep) and the compute stream
    stalled, so a missing wait or a side stream that does not wait for the compute stream changes
    the numbers: every strategy and one compiled block against one process, planted bugs that
    must FAIL. The test file says more.
(e) ``tests/test_gpu_sanitizer.py``: ``TORCH_CUDA_SANITIZER=1`` in part (d)'s four ranks over NNN,
    IIG, GGG (and a planted missing wait, which it must report), ``set_sync_debug_mode("warn")``
    from step 2 (only the non-finite guard's read expected), ``max_memory_reserved`` beside
    ``max_memory_allocated``. Its tests SKIP without CUDA.

Time budget on an H200 (estimates: the path has not run yet): (a) ~2 min, (b) ~1 min, (d) ~2 min
(compiling one block in four ranks is most of it) and (e) ~1-2 min side by side, then (c) ~3-4
min, most of it compiling 16 blocks. The timeouts (170, 120, 170, 150, then 260 s, and at most
15 s to stop a part: 460 s at worst) keep the whole run under 8 minutes; a part that times out
keeps the checks it finished. If (c) runs out of time, ``--parts c --c-layers 8`` halves the
compile work.

Without a visible CUDA device it refuses (exit code 2, one line). Exit code 1 when a check fails.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

from .checks import FAIL, SKIP, check
from .plan import BUDGET_S, CLI, PARTS, REPO, TIMEOUTS, build_plan, format_plan
from .placement import worker_b
from .report import Emitter, render_details, render_table, write_json
from .runner import device_info, run_parts, version_row
from .throughput import worker_c
from .trainer import worker_a


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {CLI}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json", help="JSON results file (default: gpu_check.json)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts to run: a (trainer), b (placement "
                    "and memory), c (throughput), d (4 ranks over the engine's streams), e (CUDA sanitizer, sync debug "
                    f"mode, reserved memory); default {','.join(PARTS)}")
    ap.add_argument("--workdir", default=str(REPO / "outputs" / "gpu_check"),
                    help="logs, trainer outputs and per-part results (default: outputs/gpu_check)")
    ap.add_argument(
        "--dry-run", action="store_true", help="print the plan and its commands, run nothing (no GPU needed)"
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak TFLOP/s for MFU "
                    "(default: by device name; H100/H200 989)")
    ap.add_argument("--c-layers", type=int, default=None, help="layers of part (c)'s model (default 16: ~1B)")
    ap.add_argument("--timeout-a", type=int, default=TIMEOUTS["a"], help=argparse.SUPPRESS)
    ap.add_argument("--timeout-b", type=int, default=TIMEOUTS["b"], help=argparse.SUPPRESS)
    ap.add_argument("--timeout-c", type=int, default=TIMEOUTS["c"], help=argparse.SUPPRESS)
    ap.add_argument("--timeout-d", type=int, default=TIMEOUTS["d"], help=argparse.SUPPRESS)
    ap.add_argument("--timeout-e", type=int, default=TIMEOUTS["e"], help=argparse.SUPPRESS)
    # hidden: run the same plan on CPU (gloo / fake group on CPU tensors, small shapes) to exercise
    # the code on a machine without a GPU; and the worker side of one part
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=("a", "b", "c"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)

    parts = [x.strip().lower() for x in ns.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown or not parts:
        print(f"gpu_check: --parts {ns.parts!r} is invalid; valid: a comma-separated subset of {','.join(PARTS)}",
              file=sys.stderr)
        return 2
    parts = [x for x in PARTS if x in parts]
    if ns.c_layers is not None and ns.c_layers < 1:
        print(f"gpu_check: --c-layers {ns.c_layers} is invalid; valid: a positive number of layers", file=sys.stderr)
        return 2
    workdir = Path(ns.workdir).resolve()

    if ns.worker:
        return run_worker(ns.worker, ns.device, Path(ns.result), workdir, ns)

    plans = build_plan(parts, ns.device, workdir, ns)
    if ns.dry_run:
        print(format_plan(plans, ns.device, ns.out, workdir, _version_line(version_row(ns.device))))
        return 0

    import torch

    if ns.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); this check is meant for a "
              f"GPU machine (python -m {CLI} --dry-run shows what it would run)", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    workdir.mkdir(parents=True, exist_ok=True)
    versions = version_row(ns.device)
    print(format_plan(plans, ns.device, ns.out, workdir, _version_line(versions)), flush=True)
    rows, part_records = run_parts(plans, workdir)
    for key in PARTS:
        if key not in parts:
            rows.append(check(key, f"{key}.*", f"part ({key})", SKIP, "not selected (--parts)"))
    rows.sort(key=lambda r: PARTS.index(r["part"]))  # stable: plan order inside a part
    rows.insert(0, versions)
    wall = time.monotonic() - t0
    print()
    print(render_table(rows))
    details = render_details(rows)
    if details:
        print()
        print(details)
    print(f"total {wall:.0f} s (budget {BUDGET_S} s)")
    passed = not any(r["status"] == FAIL for r in rows)
    payload = {"tool": CLI, "started": started, "wall_s": round(wall, 1), "budget_s": BUDGET_S,
               "device": device_info(ns.device), "parts": part_records, "checks": rows, "passed": passed,
               "command": shlex.join([sys.executable, "-m", CLI] + (argv if argv is not None else sys.argv[1:]))}
    path = write_json(ns.out, payload)
    print(f"results: {path}")
    return 0 if passed else 1


def _version_line(row: dict) -> str:
    return f"versions: {row['status']} {row['measured']} (supported: {row['limit']})"


def run_worker(part: str, device: str, result: Path, workdir: Path, ns: argparse.Namespace) -> int:
    emit = Emitter(result, part)
    workdir.mkdir(parents=True, exist_ok=True)
    if part == "a":
        worker_a(emit, device, workdir)
    elif part == "b":
        worker_b(emit, device)
    else:
        worker_c(emit, device, ns.c_layers, ns.peak_tflops)
    return 0
