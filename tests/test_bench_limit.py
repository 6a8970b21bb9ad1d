"""tools.bench's limit columns: a step beside its limit measured in the same run (unshaped links;
a node's inter bytes over the link rate) and the fraction of link time that compute hides."""
from __future__ import annotations

import pytest

from tools.bench.headline_report import format_report, hidden_of, limit_of


def row(name: str, step: float, unshaped: float | None, link: float, kind: str = "paro") -> dict:
    r = {"name": name, "kind": kind, "accum": 4, "error": None, "state_bytes": 1 << 20, "step_s": step,
         "tokens_per_s": 1000 / step, "inter_bytes": link * 125e6 / 2, "intra_bytes": 0.0, "link_s": link}
    if unshaped is not None:
        r["unshaped_s"] = unshaped
    return r


def test_limit_is_the_slower_of_compute_and_link():
    assert limit_of(row("IIG", 2.0, 1.6, 0.4)) == 1.6
    assert limit_of(row("GGG", 3.1, 2.1, 2.2)) == 2.2
    assert limit_of(row("IIG", 2.0, None, 0.4)) is None  # no unshaped round: no limit


def test_hidden_is_the_share_of_link_time_under_compute():
    assert hidden_of(row("IIG", 2.05, 1.65, 0.40)) == pytest.approx(0.0)  # the whole boundary exposed
    assert hidden_of(row("IIG", 1.75, 1.65, 0.40)) == pytest.approx(0.75)
    assert hidden_of(row("IIG", 1.60, 1.65, 0.40)) == 1.0  # faster than unshaped (noise): capped


def test_the_report_holds_the_verdicts():
    rows = [row("IIG", 1.70, 1.60, 0.40), row("NII", 1.90, 1.60, 0.30), row("fsdp2-zero3", 6.0, 4.0, 3.0, "baseline"),
            row("fsdp2-hsdp", 2.0, 1.7, 0.3, "baseline")]
    text = format_report(rows, {"n": 4, "m": 2, "topology": "shared", "rate": "1gbit", "params": 8.4e6}, None)
    assert "PaRO IIG step / its limit: 1.06x (within the 1.10x target)" in text
    assert "PaRO NII step / its limit: 1.19x (OUTSIDE the 1.10x target)" in text
    assert "best PaRO (IIG) / FSDP2 ZeRO-3 throughput: 3.53x (meets the 3.0x target)" in text
    assert "PaRO IIG / FSDP2 HSDP throughput: 1.18x (meets the 1.10x target)" in text
