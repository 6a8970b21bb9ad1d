"""``python -m tools.bench --compiled`` without the emulator: its command line, its table and
targets from synthetic rows, the link's busy fraction from counter samples, the timeline PNG, and
the compile accounting on a tiny function (dynamo's recompile log parsed; another variant's
cache entries are not this variant's recompilations). The bench itself needs root and minutes.
"""
from __future__ import annotations

import pytest

from tools.bench import compiled_emulated_report as R
from tools.bench.headline import _args


def test_compiled_defaults_and_checks():
    a = _args(["--compiled"])
    assert (a.strategies, a.accum, a.inter_rate, a.layers, a.batch, a.seq) == (
        "GGG,IGG,IIG,NIG,NII",
        "2",
        "1gbit",
        2,
        4,
        64,
    )
    assert a.out_dir == "outputs/bench/compiled" and a.variants == "eager,compiled,bucketing,reorder,all"
    q = _args(["--compiled", "--quick", "--dim", "64"])
    assert (q.strategies, q.rounds, q.warmup, q.dim) == ("GGG,IIG", 2, 0, 64)
    h = _args([])  # the headline's own defaults are untouched
    assert (h.accum, h.inter_rate, h.dim, h.batch, h.out_dir) == ("1,4", "200mbit", 128, 2, "outputs/bench")
    for bad in (["--accum", "1,2"], ["--baselines", "ddp"], ["--variants", "eager,hierarchical"], ["--dtype", "bf16"]):
        with pytest.raises(SystemExit):
            _args(["--compiled", *bad])


def _row(group, mode, tps, kind="paro", **kw):
    return {
        "kind": kind,
        "group": group,
        "mode": mode,
        "tokens_per_s": tps,
        "first_s": 0.2 if mode == "eager" else 90.0,
        "loss": 5.5,
        "error": None,
        "inter_bytes": 3 * 2**20,
        "link_util": 0.5,
        "compiles": {
            "first_graphs": 0 if mode == "eager" else 5,
            "later_graphs": 0,
            "first_recompiles": 0 if mode == "eager" else 2,
            "later_recompiles": 0,
        },
        "timeline": {"inter_busy_fraction": 0.8, "link_busy_fraction": 0.4, "overlap_fraction": 0.1},
        **kw,
    }


def test_table_ratios_targets_and_reasons():
    rows = [_row("GGG", "eager", 1000), _row("GGG", "compiled", 800), _row("GGG", "reorder", 900),
            _row("GGG", "all", 1120, reasons=["forward (llama.py:195): groups[0].last_backward == False"]),
            _row("IIG", "eager", 1000), _row("IIG", "all", 990),
            _row("fsdp2-zero3", "eager", 700, kind="fsdp2"), _row("fsdp2-zero3", "compiled", 770, kind="fsdp2"),
            _row("NII", "all", 0, error="RuntimeError: boom")]
    meta = {"n": 4, "m": 2, "rate": "1gbit", "params": 8e6, "batch": 4, "seq": 64, "accum": 2, "backend": "inductor",
            "rounds": 3}
    text = R.format_table(rows, meta)
    lines = {ln.split("  ")[0].strip(): ln for ln in text.splitlines()}
    assert "1.12   1.40" in lines["PaRO GGG compiled+all passes"]  # vs eager, vs compiled
    assert "0.90   1.12" in lines["PaRO GGG compiled+reorder"]
    assert "   1.10      -" in lines["FSDP2 ZeRO-3 compiled"]  # vs its own eager
    assert "5+0    2+0" in lines["PaRO GGG compiled"] and "3.00" in lines["PaRO GGG compiled"]
    assert "failed: RuntimeError: boom" in text
    assert "PaRO GGG compiled+all passes: 1.12x eager (target >= 1.10x), 1.40x compiled (target >= 1.25x): met" in text
    assert "PaRO IIG compiled+all passes: 0.99x eager (target >= 1.00x): NOT met" in text
    assert "recompile reasons, PaRO GGG compiled+all passes:\n  forward (llama.py:195): groups[0].last_backward" in text


def test_parse_recompile_message():
    msg = ("Recompiling function forward in /x/paro_fsdp/models/llama.py:195\n"
           "    triggered by the following guard failure(s):\n"
           "    - 3/1: self.groups[0].last_backward == False              # if g.last_backward:  # state.py:60\n"
           "    - 3/0: ___check_type_id(self, 9461), type=<class 'ParoLlama'>\n"
           "    - User stack trace:\n"
           "    -   File \"/x/state.py\", line 60, in pre_forward\n")
    where, failed = R.parse_recompile(msg)
    assert where == "forward (llama.py:195)"
    assert failed == [("3/1", "self.groups[0].last_backward == False"),
                      ("3/0", "___check_type_id(self, 9461), type=<class 'ParoLlama'>")]


def test_link_series_busy_fraction():
    rate = 1e9  # 125 MB/s
    samples = [(0.0, 0), (10.0, 1_250_000), (20.0, 1_250_100), (30.0, 1_875_100), (40.0, 1_875_100)]
    mids, mbs, busy = R.link_series(samples, rate, duration_ms=50.0)
    assert mids == [5.0, 15.0, 25.0, 35.0]
    assert mbs[0] == pytest.approx(125.0) and mbs[2] == pytest.approx(62.5) and mbs[1] < 0.1
    assert busy == pytest.approx(20.0 / 50.0)  # two of the intervals carry >= 10% of the rate
    assert R.link_series(samples[:1], rate) == ([], [], 0.0)


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = {"compute": [(0.0, 4.0), (6.0, 9.0)], "intra": [(4.0, 5.0)], "inter": [(3.0, 8.0)], "wait": [(5.0, 6.0)]}
    path = R.write_timeline_png(str(tmp_path / "t" / "x.png"), rows, 10.0, {"inter_busy_fraction": 0.5},
                                ([1.0, 3.0], [10.0, 120.0]), 1e9, "PaRO GGG compiled")
    assert path and (tmp_path / "t" / "x.png").stat().st_size > 1000
    assert R.slug({"kind": "paro", "group": "GGG", "mode": "all"}) == "paro_ggg_compiled_all_passes"


@pytest.fixture
def recompile_capture():
    import torch
    import torch._dynamo.guards as guards

    from tools.bench import compiled_emulated as C

    torch._dynamo.reset()
    C.capture_recompiles()
    yield C
    for h in [h for h in guards.recompiles_log.handlers if isinstance(h, C._Capture)]:
        guards.recompiles_log.removeHandler(h)
    guards.recompiles_log.propagate = True
    torch._logging.set_logs()
    torch._dynamo.reset()


def test_compile_accounting_tells_own_recompiles_from_other_variants(recompile_capture):
    import torch

    C = recompile_capture

    class Flag:
        def __init__(self) -> None:
            self.last = False

    def body(x, flag):
        return x * 2 if flag.last else x + 1

    a, b = Flag(), Flag()
    fa, fb = torch.compile(body, backend="eager"), torch.compile(body, backend="aot_eager")
    first_a, first_b, later_a = C.Compiles(), C.Compiles(), C.Compiles()
    own_a: set[str] = set()
    own_b: set[str] = set()
    with C.watch_compiles(first_a, own_a):  # a's first step: the model, then the last micro-step
        fa(torch.ones(3), a)
        a.last = True
        fa(torch.ones(3), a)
    assert (first_a.graphs, first_a.recompiles, len(first_a.frames)) == (2, 1, 2), first_a.frames
    assert first_a.reasons == [f"body (test_bench_compiled.py:{body.__code__.co_firstlineno}): flag.last == False"]
    with C.watch_compiles(first_b, own_b):  # another variant, same code: a's entries fail, b's first capture
        fb(torch.ones(3), b)
    assert (first_b.graphs, first_b.recompiles, first_b.reasons) == (1, 0, [])
    with C.watch_compiles(later_a, own_a):  # a again: nothing compiles
        fa(torch.ones(3), a)
    assert (later_a.graphs, later_a.recompiles) == (0, 0)


def test_lora_bench_flags():
    """--lora-rank: the same peft adapter for PaRO and the baselines; the advisor (whole trainable
    layers only) is skipped, and it does not combine with --trainable or --compiled."""
    assert _args(["--lora-rank", "8"]).no_advisor and _args([]).lora_rank == 0
    for bad in (["--lora-rank", "-1"], ["--lora-rank", "8", "--trainable", "0.5"], ["--lora-rank", "4", "--compiled"]):
        with pytest.raises(SystemExit):
            _args(bad)
