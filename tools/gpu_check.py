"""One command that checks the CUDA + NCCL path on one GPU, in under 8 minutes on an H200.

    python -m tools.gpu_check [--out gpu_check.json] [--parts a,b,c] [--workdir outputs/gpu_check]
    python -m tools.gpu_check --dry-run        # the plan and every command it would run; no GPU needed

Why: ``torchrun --nproc-per-node 8 train.py --job.config_file train_configs/llama7b_paro.toml``
is what users run on CUDA clusters, and none of that path had run on a GPU when this was written
(the machine it was built on has no GPU). One GPU cannot show NCCL across ranks, but it can show
everything else: the trainer with NCCL, every engine buffer on the device, memory against the
engine's own accounting and throughput against FSDP2. Each part runs in its own subprocess with a
timeout, so a crash or a hang in one part does not hide the others; (a) and (b) run side by side
(neither measures time), then (c) alone. The table shows PASS / FAIL / SKIP and what was measured;
``--out`` gets the same as JSON, and ``--workdir`` keeps every subprocess's log.

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
    PaRO GGG eager and compiled (per block, the trainer's ``apply_compile`` with the graph passes),
    FSDP2 ``fully_shard`` (bf16 ``MixedPrecisionPolicy``, per block then root) eager and compiled
    (per block). 3 warm-up steps (the first one compiles, timed apart), then 10 steps timed with
    CUDA events. MFU = tokens/s x (6 x non-embedding parameters + 12 x layers x dim x seq) / the
    GPU's dense bf16 peak (H100/H200: 989 TFLOP/s; ``--peak-tflops`` for others). All variants start
    from the same weights and data, so their first losses must agree (relative 1e-2).

Time budget on an H200 (estimates: the path has not run yet): (a) ~2 min and (b) ~1 min side by
side, then (c) ~3-4 min, most of it compiling 16 blocks. The timeouts (170, 120 and 260 s, and at
most 15 s to stop a part) keep the whole run under 8 minutes; a part that times out keeps the
checks it finished. If (c) runs out of time, ``--parts c --c-layers 8`` halves the compile work.

Without a visible CUDA device it refuses (exit code 2, one line). Exit code 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

REPO = Path(__file__).resolve().parent.parent
PARTS = ("a", "b", "c")
TIMEOUTS = {"a": 170, "b": 120, "c": 260}
EXCLUSIVE = {"c"}  # measures time: runs alone, after the others
BUDGET_S = 8 * 60
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

# dense bf16 peak FLOP/s per GPU, by a substring of torch.cuda.get_device_name(); first match wins
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)

# ---- (a) the trainer ------------------------------------------------------------------------------
A_CONFIG = "train_configs/debug_paro.toml"
A_STEPS, A_RESUME_FROM = 20, 10
A_COMMON = ["--parallelism.paro_group_size", "1", "--training.global_batch_size", "16", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--profiling.enable_profiling", "false"]
A_FP32 = ["--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32"]
A_BF16 = ["--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "bfloat16"]
# the seeded init draws from the CPU generator on every device, so GPU runs start from the CPU
# reference's exact weights (by default a GPU draws its own values)
A_ENV = {"PARO_INIT_RNG": "cpu"}
LOSS_RTOL, COMPILE_RTOL, FIRST_LOSS_RTOL, MEMORY_TOL = 1e-4, 1e-3, 1e-2, 0.10

# ---- (b) and (c) shapes: (cuda, cpu) ----------------------------------------------------------------
# the cpu entries only exercise the code paths on a machine without a GPU (the hidden --device cpu)
B_SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=176, max_seq_len=64)
B_MEMORY = {"cuda": (dict(dim=4096, n_layers=2, n_heads=32, vocab_size=32000, ffn_dim=11008, max_seq_len=2048), 1, 2048),
            "cpu": (dict(dim=512, n_layers=2, n_heads=8, vocab_size=4000, ffn_dim=1376, max_seq_len=256), 1, 256)}
B_MEMORY_STRATEGIES = ("IIG", "GGG", "ING")
C_MODEL = {"cuda": (dict(dim=2048, n_heads=16, vocab_size=32000, ffn_dim=5632, max_seq_len=2048), 16, 4, 2048),
           "cpu": (dict(dim=128, n_heads=4, vocab_size=1024, ffn_dim=352, max_seq_len=128), 2, 2, 128)}
C_WARMUP, C_TIMED, C_STRATEGY = 3, 10, "GGG"
C_VARIANTS = (("fsdp2_eager", "FSDP2 eager"), ("paro_eager", f"PaRO {C_STRATEGY} eager"),
              ("fsdp2_compiled", "FSDP2 compiled"), ("paro_compiled", f"PaRO {C_STRATEGY} compiled"))


# =================================================================================================
# Pure functions (no torch): comparisons, arithmetic, the table, the JSON file
# =================================================================================================
def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def compare_losses(reference: dict[int, float], other: dict[int, float], rtol: float = LOSS_RTOL,
                   steps: Optional[Iterable[int]] = None) -> dict[str, Any]:
    """Per-step losses of ``other`` against ``reference``: each step must be present in both and
    finite, and differ by at most ``rtol`` x max(1, |reference|) (relative to the loss; absolute
    below 1). ``steps``: the steps to compare (default: every step of ``reference``)."""
    steps = sorted(reference) if steps is None else sorted(steps)
    missing = [s for s in steps if s not in reference or s not in other]
    worst_step, max_abs, max_rel, bad = None, 0.0, 0.0, []
    for s in steps:
        if s in missing:
            continue
        a, b = reference[s], other[s]
        if not (_finite(a) and _finite(b)):
            bad.append(s)
            continue
        diff = abs(a - b)
        rel = diff / max(1.0, abs(a))
        if rel > max_rel or worst_step is None:
            worst_step, max_rel = s, max(rel, max_rel)
        max_abs = max(max_abs, diff)
        if rel > rtol:
            bad.append(s)
    ok = bool(steps) and not missing and not bad
    return {"ok": ok, "steps": len(steps), "missing": missing, "failing_steps": bad, "max_abs": max_abs,
            "max_rel": max_rel, "worst_step": worst_step, "rtol": rtol}


def loss_falls(losses: dict[int, float], window: int = 3, min_drop: float = 0.05) -> dict[str, Any]:
    """Whether a run trained: every loss finite and the mean of the last ``window`` steps at least
    ``min_drop`` (a fraction) below the mean of the first ``window``."""
    steps = sorted(losses)
    values = [losses[s] for s in steps]
    if len(values) < 2 * window:
        return {"ok": False, "why": f"{len(values)} steps, need at least {2 * window}", "first": None, "last": None}
    if not all(_finite(v) for v in values):
        return {"ok": False, "why": "non-finite loss", "first": None, "last": None}
    first, last = sum(values[:window]) / window, sum(values[-window:]) / window
    ok = last <= first * (1.0 - min_drop)
    return {"ok": ok, "why": "" if ok else f"loss {first:.4f} -> {last:.4f} fell less than {min_drop:.0%}",
            "first": first, "last": last, "drop": 1.0 - last / first if first else 0.0}


def flops_per_token(n_params: int, embedding_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token: 6 per weight that multiplies (the token
    embedding is a lookup, so it is left out) plus attention's 12 x layers x dim x seq_len (scores
    and weighted sum, forward and backward; the causal mask's saving is not subtracted)."""
    return 6.0 * (n_params - embedding_params) + 12.0 * n_layers * dim * seq_len


def mfu(tokens_per_s: float, flops_token: float, peak_flops: Optional[float]) -> Optional[float]:
    """Model FLOP utilisation (a fraction), or None when the peak is unknown."""
    if not peak_flops or peak_flops <= 0 or not _finite(tokens_per_s):
        return None
    return tokens_per_s * flops_token / peak_flops


def peak_bf16_flops(device_name: str, override_tflops: Optional[float] = None) -> Optional[float]:
    """One GPU's dense bf16 peak FLOP/s: ``override_tflops`` if given, else by name; None if unknown."""
    if override_tflops:
        return override_tflops * 1e12
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def expected_peak(report: dict[str, int], working_set: float) -> dict[str, float]:
    """What a training step should peak at: the persistent model states P + G + OS of
    ``memory_report``, plus the larger of the forward/backward working set and what the
    accumulation boundary adds (``master_grads`` + ``boundary``, when the report has them)."""
    states = float(report["P"] + report["G"] + report["OS"])
    boundary = float(report.get("master_grads", 0) + report.get("boundary", 0))
    return {"states": states, "boundary": boundary, "working_set": float(working_set),
            "expected": states + max(float(working_set), boundary)}


def memory_within(measured: float, expected: float, tol: float = MEMORY_TOL) -> dict[str, Any]:
    """``measured`` within ``tol`` (a fraction) of ``expected``, either way."""
    ratio = measured / expected if expected > 0 else float("inf")
    return {"ok": expected > 0 and abs(ratio - 1.0) <= tol, "ratio": ratio, "tol": tol}


def check(part: str, cid: str, name: str, status: str, measured: str = "", limit: str = "", **data: Any) -> dict[str, Any]:
    """One row of the table (and of the JSON)."""
    return {"part": part, "id": cid, "name": name, "status": status, "measured": measured, "limit": limit, "data": data}


def render_table(checks: list[dict[str, Any]]) -> str:
    """The checks as an aligned text table: part, check, status, measured, limit."""
    head = ("part", "check", "status", "measured", "limit")
    rows = [(c["part"], c["name"], c["status"], c.get("measured", ""), c.get("limit", "")) for c in checks]
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    widths[3] = min(widths[3], 90)

    def line(r: tuple) -> str:
        cells = [str(v) for v in r]
        return "  ".join(cells[i].ljust(widths[i]) if i < 4 else cells[i] for i in range(len(cells))).rstrip()

    out = [line(head), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    counts = {s: sum(c["status"] == s for c in checks) for s in (PASS, FAIL, SKIP)}
    out.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    return "\n".join(out)


def render_details(checks: list[dict[str, Any]]) -> str:
    """Below the table: every key of each memory case's ``memory_report``, and part (c) as a
    throughput table with ratios to FSDP2 eager."""
    out = []
    for c in checks:
        d = c.get("data") or {}
        if isinstance(d.get("report"), dict):
            out.append(f"{c['id']} memory_report: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d["report"].items())
                       + f"; measured peak {fmt_bytes(d.get('peak', 0))}, resident after a step {fmt_bytes(d.get('resident', 0))}")
    tput = [c for c in checks if c["part"] == "c" and "tokens_per_s" in (c.get("data") or {})]
    if tput:
        if out:
            out.append("")
        out.append(f"{'variant':<22}{'tok/s':>10}{'ms/step':>9}{'MFU':>7}{'vs FSDP2 eager':>16}{'1st step s':>12}{'peak mem':>12}")
        for c in tput:
            d = c["data"]
            m = f"{100 * d['mfu']:.1f}%" if d.get("mfu") is not None else "n/a"
            r = f"{d['ratio_vs_fsdp2_eager']:.2f}" if d.get("ratio_vs_fsdp2_eager") is not None else "-"
            pk = fmt_bytes(d["peak_memory"]) if d.get("peak_memory") else "-"
            out.append(f"{c['name']:<22}{d['tokens_per_s']:>10,.0f}{d['step_ms']:>9.1f}{m:>7}{r:>16}{d['first_step_s']:>12.1f}{pk:>12}")
    return "\n".join(out)


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, atomically (a temporary file renamed into place);
    non-finite floats become null so that any JSON reader can load it."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean(payload), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_metric(metrics_jsonl: str | os.PathLike, key: str = "loss/train") -> dict[int, float]:
    """Per-step values of ``key`` from a trainer's ``metrics.jsonl`` (one JSON record per logged step)."""
    out: dict[int, float] = {}
    p = Path(metrics_jsonl)
    if not p.exists():
        return out
    for raw in p.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec and key in rec:
            out[int(rec["step"])] = float(rec[key])
    return out


def read_losses(metrics_jsonl: str | os.PathLike) -> dict[int, float]:
    """Per-step training losses (``loss/train``) from a trainer's ``metrics.jsonl``."""
    return read_metric(metrics_jsonl, "loss/train")


def fmt_bytes(n: float) -> str:
    """GiB with two decimals, or MiB below 1 GiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    keep = [t for t in text if t.strip()][-lines:]
    return " | ".join(t.strip()[:200] for t in keep)


# =================================================================================================
# The plan
# =================================================================================================
@dataclass
class PartPlan:
    key: str
    title: str
    timeout_s: int
    checks: list[tuple[str, str]]  # (id, name)
    worker: list[str]  # the subprocess that runs the part
    runs: list[tuple[str, list[str]]] = field(default_factory=list)  # what the worker itself starts
    notes: list[str] = field(default_factory=list)


def train_runs(device: str, workdir: Path, python: str = sys.executable) -> dict[str, list[str]]:
    """The trainer subprocesses of part (a), by name (run from the repository root)."""
    gpu_backend = "nccl" if device == "cuda" else "gloo"
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    base = ["train.py", "--job.config_file", A_CONFIG] + A_COMMON
    d = lambda name: ["--job.dump_folder", str(workdir / name)]  # noqa: E731
    steps = ["--training.steps", str(A_STEPS)]
    no_ckpt = ["--checkpoint.enable", "false"]
    ckpt = str((workdir / "fp32_nccl" / "checkpoint").resolve())
    return {
        "fp32_gloo": [python] + base + A_FP32 + steps + no_ckpt + ["--comm.backend", "gloo"] + d("fp32_gloo"),
        "fp32_nccl": torchrun + base + A_FP32 + steps + ["--comm.backend", gpu_backend] + d("fp32_nccl")
        + ["--checkpoint.enable", "true", "--checkpoint.interval", str(A_RESUME_FROM), "--checkpoint.keep_latest_k", "0"],
        "bf16_nccl": torchrun + base + A_BF16 + steps + no_ckpt + ["--comm.backend", gpu_backend] + d("bf16_nccl"),
        "compile_nccl": torchrun + base + A_FP32 + steps + no_ckpt + ["--compile.enable", "--comm.backend", gpu_backend]
        + d("compile_nccl"),
        "resume_nccl": torchrun + base + A_FP32 + steps + ["--comm.backend", gpu_backend] + d("resume_nccl")
        + ["--checkpoint.enable", "true", "--checkpoint.folder", ckpt, "--checkpoint.load_step", str(A_RESUME_FROM),
           "--checkpoint.interval", "1000"],
    }


def build_plan(parts: list[str], device: str, workdir: Path, opts: argparse.Namespace) -> list[PartPlan]:
    py = sys.executable
    me = [py, "-m", "tools.gpu_check"]
    hidden = ["--device", device] if device != "cuda" else []
    plans = []
    for key in parts:
        result = workdir / f"{key}.jsonl"
        worker = me + ["--worker", key, "--result", str(result), "--workdir", str(workdir / key)] + hidden
        if key == "a":
            runs = train_runs(device, workdir / "a", py)
            p = PartPlan("a", "the trainer on 1 GPU (NCCL, 1x1 mesh, debug Llama, IIG)", opts.timeout_a, [
                ("a.fp32", f"fp32 losses NCCL = gloo CPU ({A_STEPS} steps)"),
                ("a.bf16", "bf16 params + grads train (loss falls)"),
                ("a.compile", f"--compile.enable trains ({A_STEPS} steps)"),
                ("a.resume", f"resume from step {A_RESUME_FROM} reproduces {A_RESUME_FROM + 1}..{A_STEPS}"),
            ], worker, [(name, argv) for name, argv in runs.items()], [
                "fp32_gloo, fp32_nccl, bf16_nccl and compile_nccl start side by side; resume_nccl when fp32_nccl is done",
                "losses: each run's <dump_folder>/metrics.jsonl (loss/train per step)"])
        elif key == "b":
            args, b, t = B_MEMORY[device]
            p = PartPlan("b", f"engine buffers on {device} and memory, fake 8-rank process group as a 2x4 mesh",
                         opts.timeout_b, [("b.placement", "27 strategies: every buffer on " + device)]
                         + [(f"b.mem.{s}", f"memory {s}, 7B-shaped 2-layer slice" if device == "cuda"
                             else f"memory {s}, small 2-layer slice") for s in B_MEMORY_STRATEGIES],
                         worker, notes=[
                             f"placement: Llama {B_SMALL['dim']}x{B_SMALL['n_layers']} layers, one forward/backward/clip/step per strategy",
                             f"memory: Llama dim {args['dim']}, {args['n_layers']} layers, ffn {args['ffn_dim']}, vocab {args['vocab_size']}, "
                             f"batch {b} x {t}, bf16; peak of step 2 vs P+G+OS + max(working set, master_grads + boundary)",
                             "working set: measured, an unsharded single-device forward/backward of the same slice and batch"])
        else:
            kw, layers, b, t = C_MODEL[device]
            layers = opts.c_layers or layers
            p = PartPlan("c", f"tokens/s and MFU, ~1B Llama on one {device} rank: PaRO vs FSDP2", opts.timeout_c,
                         [(f"c.{vid}", title) for vid, title in C_VARIANTS], worker, notes=[
                             f"Llama dim {kw['dim']}, {layers} layers, {kw['n_heads']} heads, ffn {kw['ffn_dim']}, "
                             f"vocab {kw['vocab_size']}; micro-batch {b} x {t} tokens, bf16, fused AdamW",
                             f"{C_WARMUP} warm-up steps (the first compiles), {C_TIMED} timed steps "
                             + ("(CUDA events)" if device == "cuda" else "(wall clock)"),
                             "compiled = per block: PaRO through the trainer's apply_compile (graph passes), FSDP2 block.compile()"])
        plans.append(p)
    return plans


def format_plan(plans: list[PartPlan], device: str, out: str, workdir: Path) -> str:
    side = [p.key for p in plans if p.key not in EXCLUSIVE]
    alone = [p.key for p in plans if p.key in EXCLUSIVE]
    total = max([p.timeout_s for p in plans if p.key in side] or [0]) + sum(p.timeout_s for p in plans if p.key in alone)
    order = " and ".join(side) + (" side by side" if len(side) > 1 else "")
    order += (", then " if side and alone else "") + " ".join(alone) + (" alone" if alone else "")
    lines = [f"gpu_check plan: device {device}; parts {', '.join(p.key for p in plans)} ({order}); "
             f"at most {total} s with the timeouts; JSON to {out}, logs under {workdir}"]
    for p in plans:
        lines.append(f"({p.key}) {p.title} - timeout {p.timeout_s} s")
        lines.append(f"    subprocess: {shlex.join(p.worker)}")
        for note in p.notes:
            lines.append(f"    {note}")
        env = " ".join(f"{k}={v}" for k, v in A_ENV.items()) + " " if p.runs else ""
        for name, argv in p.runs:
            lines.append(f"    {name}: {env}{shlex.join(argv)}")
        for cid, name in p.checks:
            lines.append(f"    check {cid}: {name}")
    return "\n".join(lines)


# =================================================================================================
# The parent: run the parts, collect, print, write
# =================================================================================================
def _device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"type": device, "torch": torch.__version__}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(0), count=torch.cuda.device_count(),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            pass
    return info


def _read_results(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for raw in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                pass
    return out


def _finish_part(plan: PartPlan, results: list[dict[str, Any]], why_missing: str) -> list[dict[str, Any]]:
    """The part's rows in plan order: what the worker reported, FAIL for what it did not."""
    got = {r["id"]: r for r in results}
    rows = [got.pop(cid) if cid in got else check(plan.key, cid, name, FAIL, why_missing) for cid, name in plan.checks]
    return rows + list(got.values())


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (its worker stops its own children: torchrun starts the
    trainer in a session of its own), SIGKILL after 15 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_parts(plans: list[PartPlan], workdir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the parts' subprocesses ((a) and (b) side by side, then (c) alone), each in its own
    process group with its timeout; return the rows and per-part records."""
    rows: dict[str, list[dict[str, Any]]] = {}
    parts: dict[str, Any] = {}
    phases = [[p for p in plans if p.key not in EXCLUSIVE], [p for p in plans if p.key in EXCLUSIVE]]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    running: dict[str, tuple[PartPlan, subprocess.Popen, float, Path, Any]] = {}
    try:
        _run_phases(phases, workdir, env, running, rows, parts)
    finally:  # Ctrl-C or an error here: no part keeps running (or holding the GPU) behind our back
        for _, proc, _, _, log in running.values():
            if proc.poll() is None:
                _kill(proc)
            log.close()
    ordered = [r for p in plans for r in rows.get(p.key, [])]
    return ordered, parts


def _run_phases(phases: list[list[PartPlan]], workdir: Path, env: dict[str, str], running: dict[str, Any],
                rows: dict[str, list[dict[str, Any]]], parts: dict[str, Any]) -> None:
    for phase in phases:
        for p in phase:
            part_dir = workdir / p.key
            shutil.rmtree(part_dir, ignore_errors=True)
            part_dir.mkdir(parents=True, exist_ok=True)
            result = workdir / f"{p.key}.jsonl"
            result.unlink(missing_ok=True)
            log_path = workdir / f"{p.key}.log"
            log = open(log_path, "w", encoding="utf-8")
            proc = subprocess.Popen(p.worker, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            running[p.key] = (p, proc, time.monotonic(), log_path, log)
            print(f"({p.key}) started: {p.title} (timeout {p.timeout_s} s, log {log_path})", flush=True)
        while running:
            time.sleep(0.5)
            for key in list(running):
                p, proc, t0, log_path, log = running[key]
                elapsed = time.monotonic() - t0
                rc = proc.poll()
                timed_out = rc is None and elapsed > p.timeout_s
                if rc is None and not timed_out:
                    continue
                if timed_out:
                    _kill(proc)
                    rc = proc.returncode
                log.close()
                del running[key]
                results = _read_results(workdir / f"{key}.jsonl")
                if timed_out:
                    why = f"not reached: part timed out after {p.timeout_s} s"
                elif rc != 0:
                    why = f"not reached: part crashed (exit {rc}): {_tail(log_path)}"
                else:
                    why = "not reported by the part"
                rows[key] = _finish_part(p, results, why)
                status = FAIL if any(r["status"] == FAIL for r in rows[key]) else PASS
                parts[key] = {"title": p.title, "status": status, "rc": rc, "timed_out": timed_out,
                              "seconds": round(elapsed, 1), "timeout_s": p.timeout_s, "log": str(log_path),
                              "command": shlex.join(p.worker)}
                print(f"({key}) {'timed out' if timed_out else 'finished'} after {elapsed:.0f} s: "
                      + ", ".join(f"{r['id']} {r['status']}" for r in rows[key]), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json", help="JSON results file (default: gpu_check.json)")
    ap.add_argument("--parts", default="a,b,c", help="comma-separated parts to run: a (trainer), b (placement and "
                    "memory), c (throughput); default a,b,c")
    ap.add_argument("--workdir", default=str(REPO / "outputs" / "gpu_check"),
                    help="logs, trainer outputs and per-part results (default: outputs/gpu_check)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its commands, run nothing (no GPU needed)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak TFLOP/s for MFU "
                    "(default: by device name; H100/H200 989)")
    ap.add_argument("--c-layers", type=int, default=None, help="layers of part (c)'s model (default 16: ~1B)")
    ap.add_argument("--timeout-a", type=int, default=TIMEOUTS["a"], help=argparse.SUPPRESS)
    ap.add_argument("--timeout-b", type=int, default=TIMEOUTS["b"], help=argparse.SUPPRESS)
    ap.add_argument("--timeout-c", type=int, default=TIMEOUTS["c"], help=argparse.SUPPRESS)
    # hidden: run the same plan on CPU (gloo / fake group on CPU tensors, small shapes) to exercise
    # the code on a machine without a GPU; and the worker side of one part
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=PARTS, default=None, help=argparse.SUPPRESS)
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
        print(format_plan(plans, ns.device, ns.out, workdir))
        return 0

    import torch

    if ns.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); this check is meant for a "
              "GPU machine (python -m tools.gpu_check --dry-run shows what it would run)", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    workdir.mkdir(parents=True, exist_ok=True)
    print(format_plan(plans, ns.device, ns.out, workdir), flush=True)
    rows, part_records = run_parts(plans, workdir)
    for key in PARTS:
        if key not in parts:
            rows.append(check(key, f"{key}.*", f"part ({key})", SKIP, "not selected (--parts)"))
    rows.sort(key=lambda r: PARTS.index(r["part"]))  # stable: plan order inside a part
    wall = time.monotonic() - t0
    print()
    print(render_table(rows))
    details = render_details(rows)
    if details:
        print()
        print(details)
    print(f"total {wall:.0f} s (budget {BUDGET_S} s)")
    passed = not any(r["status"] == FAIL for r in rows)
    payload = {"tool": "tools.gpu_check", "started": started, "wall_s": round(wall, 1), "budget_s": BUDGET_S,
               "device": _device_info(ns.device), "parts": part_records, "checks": rows, "passed": passed,
               "command": shlex.join([sys.executable, "-m", "tools.gpu_check"] + (argv if argv is not None else sys.argv[1:]))}
    path = write_json(ns.out, payload)
    print(f"results: {path}")
    return 0 if passed else 1


# =================================================================================================
# Workers (one per part, each in its own subprocess)
# =================================================================================================
class Emitter:
    """Appends one JSON line per check to the part's result file as soon as it is known, so that
    a later crash or timeout keeps what was already measured."""

    def __init__(self, path: Path, part: str) -> None:
        self.path, self.part = path, part
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, row: dict[str, Any]) -> None:
        print(f"[{row['id']}] {row['status']} {row['measured']}", flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")


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


# ---- (a) ----------------------------------------------------------------------------------------
def worker_a(emit: Emitter, device: str, workdir: Path) -> None:
    runs = train_runs(device, workdir)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 4) // 4)), **A_ENV)
    procs: dict[str, tuple[subprocess.Popen, Any, float]] = {}
    done: dict[str, dict[str, Any]] = {}

    def start(name: str) -> None:
        log = open(workdir / f"{name}.log", "w", encoding="utf-8")
        print(f"start {name}: {' '.join(f'{k}={v}' for k, v in A_ENV.items())} {shlex.join(runs[name])}", flush=True)
        procs[name] = (subprocess.Popen(runs[name], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env), log,
                       time.monotonic())

    def losses(name: str) -> dict[int, float]:
        return read_losses(workdir / name / "metrics.jsonl")

    def failed(name: str) -> Optional[str]:
        d = done[name]
        return None if d["rc"] == 0 else f"{name} exited {d['rc']}: {_tail(workdir / f'{name}.log')}"

    def stop(signum: int, frame: Any) -> None:  # the parent's timeout: stop the trainers first
        for proc, _, _ in procs.values():
            proc.terminate()
        deadline = time.monotonic() + 10
        for proc, _, _ in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    for name in ("fp32_gloo", "fp32_nccl", "bf16_nccl", "compile_nccl"):
        start(name)
    emitted: set[str] = set()
    while procs or len(emitted) < 4:
        time.sleep(0.5)
        for name in list(procs):
            proc, log, t0 = procs[name]
            if proc.poll() is None:
                continue
            log.close()
            done[name] = {"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1)}
            del procs[name]
            print(f"{name} finished: exit {proc.returncode} in {done[name]['seconds']} s", flush=True)
            if name == "fp32_nccl":
                if proc.returncode == 0:
                    start("resume_nccl")
                else:  # nothing to resume from
                    done["resume_nccl"] = {"rc": -1, "seconds": 0.0}
        if "a.fp32" not in emitted and {"fp32_gloo", "fp32_nccl"} <= done.keys():
            emitted.add("a.fp32")
            why = failed("fp32_gloo") or failed("fp32_nccl")
            ref, gpu = losses("fp32_gloo"), losses("fp32_nccl")
            cmp = compare_losses(ref, gpu, LOSS_RTOL, steps=range(1, A_STEPS + 1))
            ok = why is None and cmp["ok"]
            text = why or (f"max rel diff {cmp['max_rel']:.1e} over {cmp['steps']} steps (step {cmp['worst_step']}); "
                           f"loss {gpu.get(1, float('nan')):.4f} -> {gpu.get(A_STEPS, float('nan')):.4f}"
                           + (f"; missing steps {cmp['missing']}" if cmp["missing"] else ""))
            emit(check("a", "a.fp32", f"fp32 losses NCCL = gloo CPU ({A_STEPS} steps)", PASS if ok else FAIL, text,
                       f"rel <= {LOSS_RTOL:g}", compare=cmp, gloo=ref, nccl=gpu, runs={k: done[k] for k in ("fp32_gloo", "fp32_nccl")}))
        if "a.bf16" not in emitted and "bf16_nccl" in done:
            emitted.add("a.bf16")
            why = failed("bf16_nccl")
            got = losses("bf16_nccl")
            fall = loss_falls(got)
            ok = why is None and fall["ok"] and len(got) == A_STEPS
            text = why or (f"loss {fall['first']:.4f} -> {fall['last']:.4f} (mean of first / last 3 of {len(got)} steps)"
                           if fall["first"] is not None else fall["why"])
            emit(check("a", "a.bf16", "bf16 params + grads train (loss falls)", PASS if ok else FAIL, text,
                       "falls >= 5%, all finite", falls=fall, losses=got, run=done["bf16_nccl"]))
        if "a.compile" not in emitted and {"compile_nccl", "fp32_nccl"} <= done.keys():
            emitted.add("a.compile")
            why = failed("compile_nccl")
            got, eager = losses("compile_nccl"), losses("fp32_nccl")
            cmp = compare_losses(eager, got, COMPILE_RTOL, steps=range(1, A_STEPS + 1))
            ok = why is None and cmp["ok"]
            first_step = read_metric(workdir / "compile_nccl" / "metrics.jsonl", "time/step_s").get(1, float("nan"))
            text = why or (f"{len(got)} steps, max rel diff to eager {cmp['max_rel']:.1e}; first (compiling) step "
                           f"{first_step:.0f} s, run {done['compile_nccl']['seconds']:.0f} s")
            emit(check("a", "a.compile", f"--compile.enable trains ({A_STEPS} steps)", PASS if ok else FAIL, text,
                       f"rel <= {COMPILE_RTOL:g} vs eager", compare=cmp, losses=got, run=done["compile_nccl"]))
        if "a.resume" not in emitted and {"resume_nccl", "fp32_nccl"} <= done.keys():
            emitted.add("a.resume")
            why = failed("fp32_nccl") or failed("resume_nccl")
            first, resumed = losses("fp32_nccl"), losses("resume_nccl")
            steps = range(A_RESUME_FROM + 1, A_STEPS + 1)
            cmp = compare_losses(first, resumed, LOSS_RTOL, steps=steps)
            extra = sorted(set(resumed) - set(steps))
            ok = why is None and cmp["ok"] and not extra
            text = why or (f"steps {min(resumed, default=0)}..{max(resumed, default=0)}: max rel diff {cmp['max_rel']:.1e}"
                           + (f"; unexpected steps {extra} (did not resume?)" if extra else ""))
            emit(check("a", "a.resume", f"resume from step {A_RESUME_FROM} reproduces {A_RESUME_FROM + 1}..{A_STEPS}",
                       PASS if ok else FAIL, text, f"rel <= {LOSS_RTOL:g}", compare=cmp, resumed=resumed,
                       run=done["resume_nccl"]))


# ---- shared by (b) and (c): models, init, memory -------------------------------------------------
def _llama_args(**kw: Any):
    from paro_fsdp.models.llama import LlamaArgs

    return LlamaArgs(**kw)


def _init_fn(seed: int = 0, n_layers: int = 2) -> Callable[[str, Any], None]:
    """Fill a whole parameter on its own device from (seed, name): fast on a GPU (no host RNG) and
    the same for PaRO and FSDP2, so both start from the same weights."""
    import zlib

    import torch

    def init(name: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            if t.dim() == 1:
                t.fill_(1.0)
                return
            std = 0.02 / (math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0)
            gen = torch.Generator(device=t.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            t.normal_(0.0, std, generator=gen)
    return init


class MemoryMeter:
    """Allocated bytes per phase, relative to the start of a session: on CUDA the caching
    allocator's counters (``memory_allocated``, ``max_memory_allocated`` reset per phase); on CPU
    (only to exercise the code here) torch.profiler's allocation events, replayed in time order."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.phases: dict[str, dict[str, float]] = {}
        self._base = 0
        self._prof = None
        self._marks: list[tuple[str, Any]] = []

    def __enter__(self) -> "MemoryMeter":
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self._replay()

    def phase(self, name: str):
        import contextlib

        import torch

        meter = self

        @contextlib.contextmanager
        def cm():
            if meter.device == "cuda":
                torch.cuda.synchronize()
                start = torch.cuda.memory_allocated() - meter._base
                torch.cuda.reset_peak_memory_stats()
                yield
                torch.cuda.synchronize()
                meter.phases[name] = {"start": start, "peak": torch.cuda.max_memory_allocated() - meter._base,
                                      "end": torch.cuda.memory_allocated() - meter._base}
            else:
                with torch.profiler.record_function(f"gpu_check::{name}"):
                    yield
        return cm()

    def _replay(self) -> None:
        from torch._C._profiler import _EventType

        allocs: list[tuple[int, int]] = []
        ranges: dict[str, tuple[int, int]] = {}
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation:
                if str(node.extra_fields.device).startswith("cpu"):
                    allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
            elif node.name.startswith("gpu_check::"):
                ranges[node.name.split("::", 1)[1]] = (node.start_time_ns, node.end_time_ns)
            stack.extend(node.children)
        allocs.sort()
        for name, (t0, t1) in ranges.items():
            cur, start, peak = 0, None, None
            for t, size in allocs:
                if t > t1:
                    break
                if t >= t0 and start is None:
                    start = peak = cur
                cur += size
                if t >= t0:
                    peak = max(peak, cur)
            if start is None:
                start = peak = cur
            self.phases[name] = {"start": float(start), "peak": float(peak), "end": float(cur)}


# ---- (b) ----------------------------------------------------------------------------------------
def fake_world(world: int = 8) -> None:
    """Make this process rank 0 of torch's fake process group of ``world`` ranks (reusing one of
    that size; a fake group of another size is replaced; a real one is an error)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(f"needs a process without a real process group (found {dist.get_backend()!r})")
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def fake_mesh(device: str, shape: tuple[int, int] = (2, 4)):
    """A ("inter", "intra") mesh of ``shape`` on the fake process group, on ``device``."""
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(shape[0] * shape[1])
    return init_device_mesh(device, shape, mesh_dim_names=("inter", "intra"))


# the engine internals the brief names: each must be found where the strategy has it
def _required_internals(strategy) -> list[str]:
    from paro_fsdp.strategy import Level

    need = ["p_locals", "master", "grad_acc"]
    if strategy.p != Level.N:
        need += ["p_flat", "full_bufs"]
    if strategy.os != Level.N:
        need += ["master_flat"]
    return need


def _tensors_of(value: Any) -> list[tuple[str, Any]]:
    import torch

    from paro_fsdp.param_group import GradAccumulator

    if isinstance(value, GradAccumulator):  # the group's G accumulator: its tensor, once allocated
        value = value.tensor
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def buffer_devices(model: Any, opt: Any, device_type: str) -> dict[str, Any]:
    """Every tensor the sharded model, its engine groups and its optimizer hold, with the ones
    not on ``device_type`` (DTensors are looked at through their local tensor)."""
    from torch.distributed.tensor import DTensor

    wrong: list[str] = []
    seen: dict[str, int] = {}
    count = 0

    def visit(label: str, kind: str, t: Any) -> None:
        nonlocal count
        if isinstance(t, DTensor):
            t = t._local_tensor
        count += 1
        seen[kind] = seen.get(kind, 0) + 1
        if t.device.type != device_type:
            wrong.append(f"{label} on {t.device}")

    for name, p in model.named_parameters():
        visit(f"parameter {name}", "parameters", p)
    for name, b in model.named_buffers():
        visit(f"buffer {name}", "buffers", b)
    missing = []
    for g in model._paro_state.groups:
        attrs = vars(g)
        for attr, value in attrs.items():
            for suffix, t in _tensors_of(value):
                visit(f"{g.name}.{attr}{suffix}", attr, t)
        for attr in _required_internals(g.strategy):
            if attr == "grad_acc" and not g.trainable:
                continue
            value = attrs.get(attr)
            if value is None or getattr(value, "tensor", value) is None:  # GradAccumulator: not allocated
                missing.append(f"{g.name}.{attr}")
        for m in g.master:
            if m.grad is not None:
                visit(f"{g.name}.master.grad", "master.grad", m.grad)
    for i, state in enumerate(opt.inner.state.values()):
        for k, v in state.items():
            if hasattr(v, "device"):
                visit(f"optimizer state {i}.{k}", f"optimizer.{k}", v)
    return {"count": count, "wrong": wrong, "missing": missing, "kinds": seen}


def placement_case(mesh: Any, device: str, strategy: str, args: Any = None) -> dict[str, Any]:
    """Shard a small Llama built on the meta device with ``strategy`` on ``mesh``, run forward,
    backward, clip, step (the trainer's fused AdamW), and look at every buffer's device after
    backward, after clipping and after the step."""
    import torch

    from paro_fsdp import MixedPrecision, ParoOptimizer, paro_shard
    from paro_fsdp.models.llama import Llama

    args = args or _llama_args(**B_SMALL)
    with torch.device("meta"):
        model = Llama(args)
    model = paro_shard(model, mesh, strategy, mp=MixedPrecision(torch.bfloat16, torch.float32),
                       param_init_fn=_init_fn(0, args.n_layers))
    model.init_buffers(torch.device(device))
    opt = ParoOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, fused=True)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)).to(device)
    out = model(tokens)
    wrong, counts, missing = [], [], set()
    if out.logits.device.type != device:
        wrong.append(f"logits on {out.logits.device}")
    out.loss.backward()
    for when, fn in (("after backward", None), ("after clip", lambda: opt.clip_grad_norm_(1.0)),
                     ("after step", opt.step)):
        if fn is not None:
            fn()
        seen = buffer_devices(model, opt, device)
        wrong += [f"{w} ({when})" for w in seen["wrong"]]
        missing |= set(seen["missing"]) if when == "after step" else set()
        counts.append(seen["count"])
    opt.zero_grad()
    return {"strategy": strategy, "tensors_checked": sum(counts), "wrong": wrong, "missing": sorted(missing),
            "kinds": seen["kinds"]}


def unsharded_working_set(args: Any, batch: int, seq: int, device: str, dtype: Any) -> dict[str, float]:
    """The working set of one training micro-step, measured: the peak of an unsharded
    single-device forward/backward of the same model and batch, above the memory in use before
    the model existed. Parameters in ``dtype``, whole, as the sharded model gathers them (with
    prefetch, a 2-layer slice has all of its blocks gathered at once); each gradient is freed as
    soon as it is produced, since the engine reduces block gradients at once and its accumulator
    is counted in the model states."""
    import torch

    from paro_fsdp.models.llama import Llama

    with torch.device("meta"):
        model = Llama(args)
    model = model.to(dtype)
    init = _init_fn(0, args.n_layers)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    with MemoryMeter(device) as meter:
        with meter.phase("build"):
            model.to_empty(device=device)
            for name, p in model.named_parameters():
                init(name, p.data)
            model.init_buffers(torch.device(device))
            x = tokens.to(device)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        with meter.phase("fwd_bwd"):
            model(x).loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = meter.phases["fwd_bwd"]["peak"]
    del model, x
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"working_set": peak, "param_bytes": float(params), "activations_and_temporaries": peak - params}


def memory_case(mesh: Any, device: str, strategy: str, args: Any, batch: int, seq: int, working_set: float) -> dict[str, Any]:
    """Peak allocated bytes of the second training step of ``strategy`` (bf16 P and G, fused
    AdamW) against ``expected_peak`` of its ``memory_report``."""
    import torch

    from paro_fsdp import MixedPrecision, ParoOptimizer, paro_shard
    from paro_fsdp.models.llama import Llama

    tokens = [torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with MemoryMeter(device) as meter:
        with meter.phase("build"):
            with torch.device("meta"):
                model = Llama(args)
            model = paro_shard(model, mesh, strategy, mp=MixedPrecision(torch.bfloat16, torch.bfloat16),
                               param_init_fn=_init_fn(0, args.n_layers))
            model.init_buffers(torch.device(device))
            opt = ParoOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.1, fused=True)

        def step(x: torch.Tensor) -> None:
            model(x.to(device)).loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

        with meter.phase("step1"):
            step(tokens[0])
        with meter.phase("step2"):
            step(tokens[1])
        report = {k: int(v) for k, v in model.memory_report(opt).items()}
    ph = meter.phases
    exp = expected_peak(report, working_set)
    within = memory_within(ph["step2"]["peak"], exp["expected"])
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"strategy": strategy, "report": report, "resident": ph["step2"]["start"], "peak": ph["step2"]["peak"],
            "peak_step1": ph["step1"]["peak"], "build_peak": ph["build"]["peak"], **exp, **within}


def worker_b(emit: Emitter, device: str) -> None:
    import torch

    from paro_fsdp.strategy import ALL_STRATEGIES

    mesh = fake_mesh(device)
    names = [str(s) for s in ALL_STRATEGIES]
    t0 = time.monotonic()
    cases, errors = [], {}
    for s in names:
        try:
            cases.append(placement_case(mesh, device, s))
        except Exception as exc:  # noqa: BLE001 - one strategy's failure must not hide the others
            errors[s] = f"{type(exc).__name__}: {exc}"[:300]
    bad = {c["strategy"]: c["wrong"][:5] + [f"missing {m}" for m in c["missing"]]
           for c in cases if c["wrong"] or c["missing"]}
    n = sum(c["tensors_checked"] for c in cases)
    ok = not bad and not errors and len(cases) == len(names)
    text = (f"{len(cases) - len(bad)}/{len(names)} strategies: {n} tensors on {device}, {time.monotonic() - t0:.0f} s"
            + (f"; wrong: {bad}" if bad else "") + (f"; errors: {errors}" if errors else ""))
    emit(check("b", "b.placement", f"27 strategies: every buffer on {device}", PASS if ok else FAIL, text,
               "every tensor", cases=cases, errors=errors))

    kw, batch, seq = B_MEMORY[device]
    args = _llama_args(**kw)
    ws = unsharded_working_set(args, batch, seq, device, torch.bfloat16)
    for s in B_MEMORY_STRATEGIES:
        name = f"memory {s}, {'7B-shaped' if device == 'cuda' else 'small'} 2-layer slice"
        try:
            r = memory_case(mesh, device, s, args, batch, seq, ws["working_set"])
        except Exception as exc:  # noqa: BLE001
            emit(check("b", f"b.mem.{s}", name, FAIL, f"{type(exc).__name__}: {exc}"[:300]))
            continue
        text = (f"peak {fmt_bytes(r['peak'])} = {r['ratio']:.3f} x expected {fmt_bytes(r['expected'])} (states "
                f"{fmt_bytes(r['states'])} + {'working set' if r['working_set'] >= r['boundary'] else 'boundary'} "
                f"{fmt_bytes(max(r['working_set'], r['boundary']))}); resident {fmt_bytes(r['resident'])}")
        emit(check("b", f"b.mem.{s}", name, PASS if r["ok"] else FAIL, text, f"within {MEMORY_TOL:.0%}",
                   unsharded=ws, **r))


# ---- (c) ----------------------------------------------------------------------------------------
def _init_world(device: str) -> Any:
    """A world of one: NCCL on GPU 0 (or gloo on CPU), as ``python train.py`` makes it."""
    import socket

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
        return dev
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _timed_steps(step: Callable[[int], Any], device: Any, warmup: int, timed: int) -> dict[str, Any]:
    import torch

    losses = []
    t0 = time.perf_counter()
    losses.append(step(0))
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for i in range(1, warmup):
        losses.append(step(i))
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(warmup, warmup + timed):
            losses.append(step(i))
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t1 = time.perf_counter()
        for i in range(warmup, warmup + timed):
            losses.append(step(i))
        seconds = time.perf_counter() - t1
    return {"first_step_s": first, "timed_s": seconds, "losses": [float(x) for x in losses]}


def worker_c(emit: Emitter, device_type: str, layers: Optional[int], peak_tflops: Optional[float]) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paro_fsdp import MixedPrecision, ParoOptimizer, init_paro_mesh, paro_shard
    from paro_fsdp.models.llama import Llama

    device = _init_world(device_type)
    kw, default_layers, batch, seq = C_MODEL[device_type]
    args = _llama_args(n_layers=layers or default_layers, **kw)
    n_params = args.num_params()
    fpt = flops_per_token(n_params, args.vocab_size * args.dim, args.n_layers, args.dim, seq)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bf16_flops(name, peak_tflops) if device.type == "cuda" else None
    tokens_per_step = batch * seq
    gen = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, args.vocab_size, (batch, seq + 1), generator=gen) for _ in range(C_WARMUP + C_TIMED)]
    torch._dynamo.config.recompile_limit = 64  # PaRO's blocks compile one after another: fail, never fall back
    torch._dynamo.config.accumulated_recompile_limit = 1024
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    print(f"model: {n_params / 1e9:.3f} B parameters, {args.n_layers} layers; {tokens_per_step} tokens per step; "
          f"{fpt / 1e9:.2f} GFLOP per token; peak {peak}", flush=True)

    def build_paro(compiled: bool):
        with torch.device("meta"):
            model = Llama(args)
        model = paro_shard(model, init_paro_mesh(1), C_STRATEGY, mp=MixedPrecision(torch.bfloat16, torch.bfloat16),
                           param_init_fn=_init_fn(0, args.n_layers))
        model.init_buffers(device)
        opt = ParoOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.1, fused=True)
        if compiled:
            from paro_fsdp.train.config import JobConfig
            from paro_fsdp.train.parallelize import apply_compile

            cfg = JobConfig()
            cfg.compile.enable, cfg.compile.scope, cfg.job.dump_folder = True, "blocks", str(REPO / "outputs" / "gpu_check")
            apply_compile(model, cfg)
            opt.compile()

        def step(i: int) -> torch.Tensor:
            if compiled:
                model.set_is_last_backward(True)  # one micro-step per step: its backward runs the boundary
            loss = model(data[i].to(device, non_blocking=True)).loss
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return model, step

    def build_fsdp2(compiled: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        with torch.device("meta"):
            model = Llama(args)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        model.to_empty(device=device)
        init = _init_fn(0, args.n_layers)
        for pname, p in model.named_parameters():
            init(pname, p.to_local())  # one rank: the local shard is the whole tensor
        model.init_buffers(device)
        if compiled:
            for block in model.layers:
                block.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

        def step(i: int) -> torch.Tensor:
            loss = model(data[i].to(device, non_blocking=True)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return model, step

    results: dict[str, dict[str, Any]] = {}
    for vid, title in C_VARIANTS:
        t0 = time.monotonic()
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if vid.startswith("paro_compiled"):
                torch._dynamo.reset()
            build = build_paro if vid.startswith("paro") else build_fsdp2
            model, step = build(vid.endswith("compiled"))
            r = _timed_steps(step, device, C_WARMUP, C_TIMED)
            r["tokens_per_s"] = tokens_per_step * C_TIMED / r["timed_s"]
            r["step_ms"] = 1e3 * r["timed_s"] / C_TIMED
            r["mfu"] = mfu(r["tokens_per_s"], fpt, peak)
            r["peak_memory"] = float(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None
            r["wall_s"] = time.monotonic() - t0
            results[vid] = r
            del model, step
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others
            import traceback

            traceback.print_exc()
            emit(check("c", f"c.{vid}", title, FAIL, f"{type(exc).__name__}: {exc}"[:300]))
            results[vid] = {"error": str(exc)}
        finally:
            if vid.startswith("paro_compiled"):
                import passes

                passes.uninstall()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = results[vid]
        if "error" in r:
            continue
        base = results.get("fsdp2_eager", {})
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else None
        first = r["losses"][0]
        ref_first = base["losses"][0] if base.get("losses") else first
        same_start = compare_losses({1: ref_first}, {1: first}, FIRST_LOSS_RTOL)
        finite = all(_finite(x) for x in r["losses"])
        ok = finite and same_start["ok"]
        text = (f"{r['tokens_per_s']:,.0f} tok/s, {r['step_ms']:.0f} ms/step, "
                + (f"MFU {100 * r['mfu']:.1f}%, " if r["mfu"] is not None else "MFU n/a (unknown peak), ")
                + (f"{ratio:.2f}x FSDP2 eager, " if ratio is not None else "")
                + f"first step {r['first_step_s']:.1f} s"
                + (f", peak {fmt_bytes(r['peak_memory'])}" if r["peak_memory"] else "")
                + ("" if finite else "; non-finite loss")
                + ("" if same_start["ok"] else f"; first loss {first:.4f} vs FSDP2 {ref_first:.4f}")
                + ("" if base.get("losses") else "; no FSDP2 eager reference"))
        emit(check("c", f"c.{vid}", title, PASS if ok else FAIL, text, "runs; first loss = FSDP2's (rel 1e-2)",
                   ratio_vs_fsdp2_eager=ratio, n_params=n_params, n_layers=args.n_layers, tokens_per_step=tokens_per_step,
                   flops_per_token=fpt, peak_flops=peak, **r))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
