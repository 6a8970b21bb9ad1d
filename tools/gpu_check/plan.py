"""What ``python -m tools.gpu_check`` runs: the parts, their timeouts and shapes, the trainer
commands of part (a), and the plan that ``--dry-run`` prints.

The timeouts keep the whole run under ``BUDGET_S``: (a), (b), (d) and (e) side by side (none of
them measures time; (d) and (e) each run four ranks on the GPU), then (c) alone. The worst case
is the longest of the first phase plus (c) plus the two 15 s stops: 170 + 260 + 30 = 460 s.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: the command line of ``cli.main``; it also runs each part (``--worker``) in its own subprocess
CLI = "tools.gpu_check"
PARTS = ("a", "b", "c", "d", "e")
TIMEOUTS = {"a": 170, "b": 120, "c": 260, "d": 170, "e": 150}
EXCLUSIVE = {"c"}  # measures time: runs alone, after the others
BUDGET_S = 8 * 60

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

# ---- (b) and (c) shapes: (cuda, cpu) ----------------------------------------------------------------
# the cpu entries only exercise the code paths on a machine without a GPU (the hidden --device cpu)
B_SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=176, max_seq_len=64)
B_MEMORY = {
    "cuda": (dict(dim=4096, n_layers=2, n_heads=32, vocab_size=32000, ffn_dim=11008, max_seq_len=2048), 1, 2048),
    "cpu": (dict(dim=512, n_layers=2, n_heads=8, vocab_size=4000, ffn_dim=1376, max_seq_len=256), 1, 256),
}
B_MEMORY_STRATEGIES = ("IIG", "GGG", "ING")
C_MODEL = {"cuda": (dict(dim=2048, n_heads=16, vocab_size=32000, ffn_dim=5632, max_seq_len=2048), 16, 4, 2048),
           "cpu": (dict(dim=128, n_heads=4, vocab_size=1024, ffn_dim=352, max_seq_len=128), 2, 2, 128)}
C_WARMUP, C_TIMED, C_STRATEGY = 3, 10, "GGG"
C_VARIANTS = (("fsdp2_eager", "FSDP2 eager"), ("paro_eager", f"PaRO {C_STRATEGY} eager"),
              ("fsdp2_compiled", "FSDP2 compiled"), ("paro_compiled", f"PaRO {C_STRATEGY} compiled"))


# ---- the plan ----------------------------------------------------------------------------------------
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
        "fp32_nccl": torchrun
        + base
        + A_FP32
        + steps
        + ["--comm.backend", gpu_backend]
        + d("fp32_nccl")
        + [
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            str(A_RESUME_FROM),
            "--checkpoint.keep_latest_k",
            "0",
        ],
        "bf16_nccl": torchrun + base + A_BF16 + steps + no_ckpt + ["--comm.backend", gpu_backend] + d("bf16_nccl"),
        "compile_nccl": torchrun
        + base
        + A_FP32
        + steps
        + no_ckpt
        + ["--compile.enable", "--comm.backend", gpu_backend]
        + d("compile_nccl"),
        "resume_nccl": torchrun
        + base
        + A_FP32
        + steps
        + ["--comm.backend", gpu_backend]
        + d("resume_nccl")
        + [
            "--checkpoint.enable",
            "true",
            "--checkpoint.folder",
            ckpt,
            "--checkpoint.load_step",
            str(A_RESUME_FROM),
            "--checkpoint.interval",
            "1000",
        ],
    }


def build_plan(parts: list[str], device: str, workdir: Path, opts: argparse.Namespace) -> list[PartPlan]:
    py = sys.executable
    me = [py, "-m", CLI]
    hidden = ["--device", device] if device != "cuda" else []
    plans = []
    for key in parts:
        result = workdir / f"{key}.jsonl"
        worker = me + ["--worker", key, "--result", str(result), "--workdir", str(workdir / key)] + hidden
        if key == "a":
            runs = train_runs(device, workdir / "a", py)
            p = PartPlan(
                "a",
                "the trainer on 1 GPU (NCCL, 1x1 mesh, debug Llama, IIG)",
                opts.timeout_a,
                [
                    ("a.fp32", f"fp32 losses NCCL = gloo CPU ({A_STEPS} steps)"),
                    ("a.bf16", "bf16 params + grads train (loss falls)"),
                    ("a.compile", f"--compile.enable trains ({A_STEPS} steps)"),
                    ("a.resume", f"resume from step {A_RESUME_FROM} reproduces {A_RESUME_FROM + 1}..{A_STEPS}"),
                ],
                worker,
                [(name, argv) for name, argv in runs.items()],
                [
                    "fp32_gloo, fp32_nccl, bf16_nccl and compile_nccl start side by side; resume_nccl when fp32_nccl "
                    "is done",
                    "losses: each run's <dump_folder>/metrics.jsonl (loss/train per step)",
                ],
            )
        elif key in STREAM_TESTS:
            p = _plan_tests(key, device, workdir, getattr(opts, f"timeout_{key}"))
        elif key == "b":
            args, b, t = B_MEMORY[device]
            p = PartPlan(
                "b",
                f"engine buffers on {device} and memory, fake 8-rank process group as a 2x4 mesh",
                opts.timeout_b,
                [("b.placement", "27 strategies: every buffer on " + device)]
                + [
                    (
                        f"b.mem.{s}",
                        f"memory {s}, 7B-shaped 2-layer slice"
                        if device == "cuda"
                        else f"memory {s}, small 2-layer slice",
                    )
                    for s in B_MEMORY_STRATEGIES
                ],
                worker,
                notes=[
                    f"placement: Llama {B_SMALL['dim']}x{B_SMALL['n_layers']} layers, one forward/backward/clip/step "
                    "per strategy",
                    f"memory: Llama dim {args['dim']}, {args['n_layers']} layers, ffn {args['ffn_dim']}, vocab "
                    f"{args['vocab_size']}, "
                    f"batch {b} x {t}, bf16; peak of step 2 vs P+G+OS + max(working set, master_grads + boundary)",
                    "working set: measured, an unsharded single-device forward/backward of the same slice and batch",
                ],
            )
        else:
            kw, layers, b, t = C_MODEL[device]
            layers = opts.c_layers or layers
            p = PartPlan(
                "c",
                f"tokens/s and MFU, ~1B Llama on one {device} rank: PaRO vs FSDP2",
                opts.timeout_c,
                [(f"c.{vid}", title) for vid, title in C_VARIANTS],
                worker,
                notes=[
                    f"Llama dim {kw['dim']}, {layers} layers, {kw['n_heads']} heads, ffn {kw['ffn_dim']}, "
                    f"vocab {kw['vocab_size']}; micro-batch {b} x {t} tokens, bf16, fused AdamW",
                    f"{C_WARMUP} warm-up steps (the first compiles), {C_TIMED} timed steps "
                    + ("(CUDA events)" if device == "cuda" else "(wall clock)"),
                    "compiled = per block: PaRO through passes.compile_model (graph passes), FSDP2 "
                    "block.compile()",
                ],
            )
        plans.append(p)
    return plans


#: parts (d) and (e): test files, run by pytest with the rows plugin, their titles and notes
STREAM_TESTS = {
    "d": (
        "tests/test_gpu_streams.py",
        "4 ranks on one {device}: real collectives over the engine's streams (stand-in kernels)",
        [
            "4 processes on the one {device} as a 2x2 mesh over gloo; every _c10d_functional collective through the "
            "stand-in kernels (tests/harness/standin.py): poisoned output, the exact result written only at its wait()"
            "{cuda_delay}",
            "Llama dim 32, 2 layers, vocab 258 (uneven over 4 ranks), 3 steps of A=2, AdamW, clip 0.5; reference: one "
            "process on {device}",
            "every strategy exact; GGG with layers.0 compiled {compiler}: collectives in its graphs, exact; "
            "the planted missing waits must FAIL (self-tests)",
        ],
    ),
    "e": (
        "tests/test_gpu_sanitizer.py",
        "CUDA sanitizer, sync debug mode and reserved memory on {device}",
        [
            "TORCH_CUDA_SANITIZER=1 in 4 spawned ranks (part (d)'s stand-in world) over NNN, IIG, GGG, eager, "
            "and GGG against IGG in bf16 (the masters sent cast on the gather stream); "
            "torch.cuda.set_sync_debug_mode('warn') from step 2 with the trainer's non-finite guard; "
            "max_memory_reserved / max_memory_allocated per run; a planted missing wait must be reported"
        ],
    ),
}


def _plan_tests(key: str, device: str, workdir: Path, timeout_s: int) -> PartPlan:
    """Part (d) or (e): pytest on its test file, each test a row (``rows.py``) as it finishes."""
    path, title, notes = STREAM_TESTS[key]
    env = [
        f"PARO_STREAMS_DEVICE={device}",
        f"PARO_GPU_CHECK_PART={key}",
        f"PARO_GPU_CHECK_ROWS={workdir / f'{key}.jsonl'}",
    ]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "tools.gpu_check.rows", "-p", "no:cacheprovider"]
    cmd = ["env", *env, *pytest, path]
    fill = dict(
        device=device,
        compiler="by inductor" if device == "cuda" else "with the passes' AOT backend",
        cuda_delay=", behind a 2 ms sleep on its own stream; the model stalls the compute stream 0.5 ms per delay point"
        if device == "cuda"
        else "",
    )
    notes = [n.format(**fill) for n in notes] + (["without CUDA every test SKIPs"] if key == "e" else [])
    return PartPlan(
        key,
        title.format(device=device),
        timeout_s,
        [(f"{key}.tests", f"pytest {path}: every test passes")],
        cmd,
        notes=notes,
    )


def phase_order(side: list[str], alone: list[str]) -> str:
    """How the parts run, in words: ``a, b, d and e side by side, then c alone``."""
    order = (", ".join(side[:-1]) + " and " + side[-1]) if len(side) > 1 else "".join(side)
    order += " side by side" if len(side) > 1 else ""
    return order + (", then " if side and alone else "") + " ".join(alone) + (" alone" if alone else "")


def format_plan(plans: list[PartPlan], device: str, out: str, workdir: Path, versions: str = "") -> str:
    side = [p.key for p in plans if p.key not in EXCLUSIVE]
    alone = [p.key for p in plans if p.key in EXCLUSIVE]
    total = max([p.timeout_s for p in plans if p.key in side] or [0]) + sum(
        p.timeout_s for p in plans if p.key in alone
    )
    lines = [f"gpu_check plan: device {device}; parts {', '.join(p.key for p in plans)} ({phase_order(side, alone)}); "
             f"at most {total} s with the timeouts; JSON to {out}, logs under {workdir}"]
    if versions:
        lines.append(versions)
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
