"""The checks' arithmetic, without torch: loss comparisons, the MFU and memory formulas, one row
of the table (``check``) and its statuses.

Why apart: these decide PASS or FAIL; they are tested on their own (``tests/test_gpu_check.py``)
on a machine without a GPU.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

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
LOSS_RTOL, COMPILE_RTOL, FIRST_LOSS_RTOL, MEMORY_TOL = 1e-4, 1e-3, 1e-2, 0.10



def is_finite(x: Any) -> bool:
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
        if not (is_finite(a) and is_finite(b)):
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
    if not all(is_finite(v) for v in values):
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
    if not peak_flops or peak_flops <= 0 or not is_finite(tokens_per_s):
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


def version_check(torch_version: str, cuda_version: Optional[str], supported: tuple[tuple[int, int], tuple[int, int]],
                  device: str) -> dict[str, Any]:
    """The first row: the running torch (``2.11.0+cu130``) inside ``supported`` ((2, 11), (2, 14)),
    inclusive by minor release; on a CUDA run the build must be a CUDA build (``cuda_version``,
    torch.version.cuda, not None)."""
    try:
        major, minor = (int(v) for v in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        return {"ok": False, "why": f"cannot read the torch version {torch_version!r}"}
    lo, hi = supported
    inside = lo <= (major, minor) <= hi
    cuda_ok = device != "cuda" or bool(cuda_version)
    why = ("" if inside else f"torch {major}.{minor} is outside {lo[0]}.{lo[1]}..{hi[0]}.{hi[1]}") + (
        "" if cuda_ok else ("; " if not inside else "") + "a CPU build of torch (torch.version.cuda is None)")
    return {"ok": inside and cuda_ok, "why": why, "range": f"{lo[0]}.{lo[1]}..{hi[0]}.{hi[1]}"}


def check(
    part: str, cid: str, name: str, status: str, measured: str = "", limit: str = "", **data: Any
) -> dict[str, Any]:
    """One row of the table (and of the JSON)."""
    return {"part": part, "id": cid, "name": name, "status": status, "measured": measured, "limit": limit, "data": data}
