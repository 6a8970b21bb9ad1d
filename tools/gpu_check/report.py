"""What ``gpu_check`` writes: the table and the details below it, the JSON file, the per-part
result lines a worker appends as it goes (``Emitter``), and reading a trainer's ``metrics.jsonl``
and a log's last lines.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .checks import FAIL, PASS, SKIP


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
            out.append(
                f"{c['id']} memory_report: "
                + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d["report"].items())
                + f"; measured peak {fmt_bytes(d.get('peak', 0))}, "
                f"resident after a step {fmt_bytes(d.get('resident', 0))}"
            )
    tput = [c for c in checks if c["part"] == "c" and "tokens_per_s" in (c.get("data") or {})]
    if tput:
        if out:
            out.append("")
        out.append(f"{'variant':<22}{'tok/s':>10}{'ms/step':>9}{'MFU':>7}{'vs FSDP2 eager':>16}"
                   f"{'1st step s':>12}{'peak mem':>12}")
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


def log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    keep = [t for t in text if t.strip()][-lines:]
    return " | ".join(t.strip()[:200] for t in keep)


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
