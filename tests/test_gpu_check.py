"""tools.gpu_check (tools/gpu_check/) on a machine without a GPU: it refuses (exit 2, one
line), --dry-run prints the plan with its commands, the pure functions (loss comparison, MFU,
memory tolerance, table, JSON) on real inputs with a failing case each, the parent's timeout /
crash handling, part (b)'s placement and memory code on CPU tensors with torch's fake process
group (2 x 4 mesh), and parts (d) and (e), the stream tests under pytest, in their CPU mode: each
test a row. The stream tests themselves: tests/test_gpu_streams.py, tests/test_gpu_sanitizer.py,
tests/test_gpu_check_streams.py."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.gpu_check import checks, memory, placement, plan, report, runner

REPO = Path(__file__).resolve().parent.parent


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.gpu_check", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **env))


# ---- the command line ---------------------------------------------------------------------------
def test_refuses_without_cuda_in_one_line(tmp_path):
    out = tmp_path / "r.json"
    p = _run(["--out", str(out), "--workdir", str(tmp_path / "w")], CUDA_VISIBLE_DEVICES="")
    assert p.returncode == 2
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, p.stderr
    assert "no CUDA device is visible" in lines[0] and "meant for a GPU machine" in lines[0]
    assert p.stdout == ""
    assert not out.exists() and not (tmp_path / "w").exists()


@pytest.mark.compat
def test_dry_run_prints_the_plan_and_its_commands(tmp_path):
    p = _run(["--dry-run", "--out", str(tmp_path / "r.json")])
    assert p.returncode == 0, p.stderr
    text = p.stdout
    for part in ("(a) the trainer", "(b) engine buffers on cuda", "(c) tokens/s and MFU", "(d) 4 ranks on one cuda",
                 "(e) CUDA sanitizer"):
        assert part in text
    assert "a, b, d and e side by side, then c alone" in text
    assert "at most 430 s with the timeouts" in text  # the longest of a, b, d, e (170 s) + c (260 s)
    # the first row: the versions against the supported range (this CPU build of torch fails it for a CUDA run)
    assert text.splitlines()[1].startswith("versions: ") and "supported: torch 2.11..2.14, a CUDA build" in text
    # part (a): the CPU reference and the NCCL runs, with the 1x1 mesh, resume and compile
    assert "train.py --job.config_file train_configs/debug_paro.toml --parallelism.paro_group_size 1" in text
    assert "-m torch.distributed.run --standalone --nproc-per-node 1 train.py" in text
    assert "--comm.backend gloo" in text and "--comm.backend nccl" in text
    assert "--checkpoint.load_step 10" in text and "--compile.enable" in text
    assert "--training.mixed_precision_param bfloat16" in text
    assert "fp32_nccl: PARO_INIT_RNG=cpu " in text  # the GPU runs start from the CPU run's weights
    for cid in ("a.fp32", "a.bf16", "a.compile", "a.resume", "b.placement", "b.mem.IIG", "b.mem.GGG", "b.mem.ING",
                "c.fsdp2_eager", "c.paro_eager", "c.fsdp2_compiled", "c.paro_compiled", "d.tests", "e.tests"):
        assert f"check {cid}:" in text
    assert "dim 4096, 2 layers, ffn 11008, vocab 32000" in text
    assert "dim 2048, 16 layers" in text
    assert "-m tools.gpu_check --worker b" in text
    # parts (d) and (e): the stream tests under pytest, each test a row
    assert "PARO_STREAMS_DEVICE=cuda PARO_GPU_CHECK_PART=d" in text and "-m pytest" in text
    assert "-p tools.gpu_check.rows -p no:cacheprovider tests/test_gpu_streams.py" in text
    assert "tests/test_gpu_sanitizer.py" in text
    assert "vocab 258" in text and "behind a 2 ms sleep" in text and "compiled by inductor" in text
    assert "TORCH_CUDA_SANITIZER=1" in text and "set_sync_debug_mode('warn') from step 2" in text
    assert not (tmp_path / "r.json").exists()


def test_dry_run_on_cpu():
    p = _run(["--dry-run", "--device", "cpu", "--parts", "d,e"])
    assert p.returncode == 0, p.stderr
    text = p.stdout
    assert "(a)" not in text and "d and e side by side" in text
    assert "PARO_STREAMS_DEVICE=cpu" in text and "with the passes' AOT backend" in text
    assert "without CUDA every test SKIPs" in text


def test_parts_select_and_bad_parts_are_refused():
    p = _run(["--dry-run", "--parts", "b"])
    assert p.returncode == 0 and "(b)" in p.stdout and "(a)" not in p.stdout and "(c)" not in p.stdout
    p = _run(["--dry-run", "--parts", "a,x"])
    assert p.returncode == 2 and "--parts" in p.stderr and "valid" in p.stderr


# ---- pure functions -----------------------------------------------------------------------------
# per-step losses of the debug Llama (fp32, 1 rank) as metrics.jsonl records them
LOSSES = {1: 5.559321880340576, 2: 5.4133219718933105, 3: 5.1702446937561035, 4: 4.850468158721924,
          5: 4.526139259338379, 6: 4.246993541717529, 7: 4.03155517578125, 8: 3.8724308013916016}


def test_compare_losses_equal_within_tolerance_and_failures():
    near = {s: v * (1 + 3e-5) for s, v in LOSSES.items()}
    r = checks.compare_losses(LOSSES, near)
    assert r["ok"] and r["steps"] == 8 and 2e-5 < r["max_rel"] < 4e-5
    off = {**near, 5: LOSSES[5] * (1 + 2e-4)}  # one step 2e-4 off
    r = checks.compare_losses(LOSSES, off)
    assert not r["ok"] and r["failing_steps"] == [5] and r["worst_step"] == 5
    missing = {s: v for s, v in LOSSES.items() if s != 8}
    r = checks.compare_losses(LOSSES, missing)
    assert not r["ok"] and r["missing"] == [8]
    assert not checks.compare_losses(LOSSES, {**LOSSES, 3: float("nan")})["ok"]
    # below 1 the tolerance is absolute; only the steps asked for are compared
    assert checks.compare_losses({1: 0.01}, {1: 0.01 + 5e-5})["ok"]
    assert checks.compare_losses(LOSSES, {6: LOSSES[6], 7: LOSSES[7]}, steps=[6, 7])["ok"]
    assert not checks.compare_losses({}, {})["ok"]


def test_loss_falls():
    r = checks.loss_falls(LOSSES)
    assert r["ok"] and r["first"] == pytest.approx(sum(list(LOSSES.values())[:3]) / 3)
    flat = {s: 5.5 - 0.01 * s for s in range(1, 9)}
    r = checks.loss_falls(flat)
    assert not r["ok"] and "fell less than" in r["why"]
    assert not checks.loss_falls({**LOSSES, 4: float("inf")})["ok"]
    assert not checks.loss_falls({1: 5.0, 2: 4.0})["ok"]


def test_flops_and_mfu_of_the_1b_model():
    from paro_fsdp.models.llama import LlamaArgs

    kw, layers, batch, seq = plan.C_MODEL["cuda"]
    args = LlamaArgs(n_layers=layers, **kw)
    n = args.num_params()
    layer = 4 * 2048 * 2048 + 3 * 2048 * 5632 + 2 * 2048
    assert n == 16 * layer + 2 * 32000 * 2048 + 2048  # 0.96 B
    fpt = checks.flops_per_token(n, 32000 * 2048, 16, 2048, 2048)
    assert fpt == 6 * (n - 32000 * 2048) + 12 * 16 * 2048 * 2048
    assert fpt == pytest.approx(6.13e9, rel=1e-2)
    peak = checks.peak_bf16_flops("NVIDIA H200")
    assert peak == 989e12 and checks.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert checks.mfu(60_000, fpt, peak) == pytest.approx(60_000 * fpt / 989e12)
    assert 0.3 < checks.mfu(60_000, fpt, peak) < 0.4
    # unknown GPU: no MFU unless the peak is given
    assert checks.peak_bf16_flops("Some Future GPU") is None and checks.mfu(60_000, fpt, None) is None
    assert checks.peak_bf16_flops("Some Future GPU", 500.0) == 500e12
    assert checks.mfu(float("nan"), fpt, peak) is None


def test_expected_peak_and_tolerance():
    GiB = 2**30
    # IIG on a 2x4 mesh, the 7B-shaped 2-layer slice: bf16 P at I, fp32 G accumulator at I,
    # fp32 master + AdamW at G
    psi = 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    mem_report = {"P": 2 * psi // 4, "G": 4 * psi // 4, "OS": 12 * psi // 8, "master_grads": 4 * psi // 8,
                  "boundary": 0}
    mem_report["total"] = mem_report["P"] + mem_report["G"] + mem_report["OS"]
    e = checks.expected_peak(mem_report, working_set=3.5 * GiB)
    assert e["states"] == mem_report["total"] and e["expected"] == mem_report["total"] + 3.5 * GiB
    assert checks.memory_within(e["expected"] * 1.08, e["expected"])["ok"]
    assert checks.memory_within(e["expected"] * 0.93, e["expected"])["ok"]
    bad = checks.memory_within(e["expected"] * 1.15, e["expected"])
    assert not bad["ok"] and bad["ratio"] == pytest.approx(1.15)
    # ING: the boundary (full-size grads) outweighs a small working set; an old report without
    # the boundary keys still works
    ing = {"P": 100, "G": 800, "OS": 50, "total": 950, "master_grads": 20, "boundary": 900}
    assert checks.expected_peak(ing, 300)["expected"] == 950 + 920
    assert checks.expected_peak({"P": 1, "G": 2, "OS": 3, "total": 6}, 10)["expected"] == 16
    assert not checks.memory_within(1.0, 0.0)["ok"]


def test_table_and_json(tmp_path):
    rows = [checks.check("a", "a.fp32", "fp32 losses NCCL = gloo CPU (20 steps)", checks.PASS, "max rel diff 2.1e-07",
                         "rel <= 0.0001"),
            checks.check("b", "b.mem.IIG", "memory IIG", checks.FAIL, "peak 6.10 GiB vs 5.00 GiB (ratio 1.220)",
                         "within 10%", ratio=1.22, bad=float("nan")),
            checks.check("c", "c.*", "part (c)", checks.SKIP, "not selected (--parts)")]
    table = report.render_table(rows)
    lines = table.splitlines()
    assert lines[0].split() == ["part", "check", "status", "measured", "limit"]
    status_col = lines[0].index("status")
    assert [ln[status_col:status_col + 4] for ln in lines[2:5]] == ["PASS", "FAIL", "SKIP"]
    assert lines[-1] == "1 passed, 1 failed, 1 skipped"
    path = report.write_json(tmp_path / "sub" / "out.json", {"checks": rows, "passed": False, "inf": math.inf})
    data = json.loads(path.read_text())
    assert data["checks"][1]["data"] == {"ratio": 1.22, "bad": None} and data["inf"] is None
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]


def test_details_list_every_report_key_and_the_throughput_ratios():
    GiB = 2**30
    mem_report = {"P": 0.31 * GiB, "G": 0.62 * GiB, "OS": 0.93 * GiB, "total": 1.86 * GiB, "master_grads": 0.31 * GiB,
                  "boundary": 0, "peak": 2.17 * GiB}
    mem = checks.check("b", "b.mem.IIG", "memory IIG", checks.PASS, "", report=mem_report, peak=5.2 * GiB,
                       resident=1.86 * GiB)
    fpt = 6.13e9

    def variant(vid, title, tps, ratio):
        return checks.check("c", f"c.{vid}", title, checks.PASS, "", tokens_per_s=tps, step_ms=8192 / tps * 1e3,
                            mfu=checks.mfu(tps, fpt, 989e12), ratio_vs_fsdp2_eager=ratio, first_step_s=2.0,
                            peak_memory=44 * GiB)

    text = report.render_details([mem, variant("fsdp2_eager", "FSDP2 eager", 50_000, 1.0),
                                  variant("paro_eager", "PaRO GGG eager", 55_000, 1.1)])
    first = text.splitlines()[0]
    for key in mem_report:
        assert f"{key} " in first
    assert "G 634.9 MiB" in first and "measured peak 5.20 GiB" in first
    lines = text.splitlines()
    assert lines[2].split()[:3] == ["variant", "tok/s", "ms/step"]
    assert lines[4].split() == ["PaRO", "GGG", "eager", "55,000", "148.9", "34.1%", "1.10", "2.0", "44.00", "GiB"]
    assert report.render_details([checks.check("a", "a.fp32", "x", checks.PASS)]) == ""


def test_read_losses_from_metrics_jsonl(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": s, "loss/train": v, "optim/lr": 1e-3}) + "\n" for s, v in LOSSES.items())
                 + "not json\n" + json.dumps({"step": 9}) + "\n")
    assert report.read_losses(f) == LOSSES
    assert report.read_losses(tmp_path / "missing.jsonl") == {}


def test_parent_keeps_what_a_part_reported_before_timeout_or_crash(tmp_path):
    def part(key: str, body: str, timeout: int) -> plan.PartPlan:
        result = tmp_path / f"{key}.jsonl"
        row = checks.check(key, f"{key}.one", "first", checks.PASS, "measured")
        code = f"import json,sys,time; open({str(result)!r},'a').write(json.dumps({row!r})+'\\n'); {body}"
        return plan.PartPlan(key, f"part {key}", timeout, [(f"{key}.one", "first"), (f"{key}.two", "second")],
                             [sys.executable, "-c", code])

    rows, parts = runner.run_parts([part("a", "time.sleep(60)", 2), part("b", "sys.exit(3)", 30)], tmp_path)
    by = {r["id"]: r for r in rows}
    assert by["a.one"]["status"] == checks.PASS and by["b.one"]["status"] == checks.PASS
    assert by["a.two"]["status"] == checks.FAIL and "timed out after 2 s" in by["a.two"]["measured"]
    assert by["b.two"]["status"] == checks.FAIL and "crashed (exit 3)" in by["b.two"]["measured"]
    assert parts["a"]["timed_out"] and parts["a"]["seconds"] < 20 and parts["b"]["rc"] == 3


# ---- part (b) on CPU tensors with the fake process group ------------------------------------------
@pytest.fixture(scope="module")
def cpu_mesh():
    import torch.distributed as dist

    mesh = placement.fake_mesh("cpu")
    yield mesh
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["IIG", "GGG", "ING", "NNN", "NGI"])
def test_placement_finds_every_buffer_on_the_mesh_device(cpu_mesh, strategy):
    r = placement.placement_case(cpu_mesh, "cpu", strategy)
    assert r["wrong"] == [] and r["missing"] == []
    kinds = r["kinds"]
    assert {"parameters", "p_locals", "master", "grad_acc", "master.grad", "optimizer.exp_avg"} <= kinds.keys()
    # bf16: where P = OS the masters are the P storage, sent cast (no p_flat)
    assert ("full_bufs" in kinds) == (strategy[0] != "N")
    assert ("p_flat" in kinds) == (strategy[0] not in ("N", strategy[2]))
    assert ("master_flat" in kinds) == (strategy[2] != "N")


def test_placement_reports_buffers_on_another_device(cpu_mesh):
    import torch

    from paro_fsdp import paro_shard
    from paro_fsdp.models.llama import Llama

    model = paro_shard(Llama(memory.llama_args(**plan.B_SMALL)), cpu_mesh, "IIG")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = placement.buffer_devices(model, opt, "cuda")  # every buffer is on the CPU: all of them are wrong
    assert seen["count"] > 0 and len(seen["wrong"]) == seen["count"]
    assert any(".p_flat on cpu" in w for w in seen["wrong"]) and any(".master[0] on cpu" in w for w in seen["wrong"])
    assert any(w.endswith(".grad_acc") for w in seen["missing"])  # no backward yet: no accumulator


def test_memory_case_on_cpu_measures_peak_and_resident_states(cpu_mesh):
    import torch

    args = memory.llama_args(dim=64, n_layers=2, n_heads=4, vocab_size=512, ffn_dim=176, max_seq_len=32)
    ws = memory.unsharded_working_set(args, 1, 32, "cpu", torch.bfloat16)
    assert ws["working_set"] > ws["param_bytes"] > 0
    r = memory.memory_case(cpu_mesh, "cpu", "IIG", args, 1, 32, ws["working_set"])
    assert {"P", "G", "OS", "total"} <= r["report"].keys()
    # after a step, what stays allocated is the model states memory_report counts, less the G
    # accumulators the boundary freed (P + OS + what is still held of G)
    assert r["resident"] == pytest.approx(r["resident_states"], rel=0.05)
    assert 0 <= r["g_held"] <= r["report"]["G"]
    assert r["peak"] > r["resident"] and r["expected"] == r["states"] + max(ws["working_set"], r["boundary"])
    assert r["ok"] == (abs(r["ratio"] - 1) <= checks.MEMORY_TOL)


# ---- parts (d) and (e) in their CPU mode: the stream tests under pytest, each test a row --------------
def test_stream_parts_report_each_test_as_a_row(tmp_path):
    """The part's pytest run through the rows plugin: a row per test as it finishes (passed,
    failed with the assertion's line, skipped with the reason, the measured property), then the
    session's row; a failing test fails the session's row. Here on a small test file written for
    it (the stream tests themselves take a minute on CPU: make test-all)."""
    tests = tmp_path / "test_probe.py"
    tests.write_text("import pytest\n"
                     "def test_ok(record_property):\n    record_property('measured', '3 exact')\n"
                     "def test_bad():\n    assert 1 == 2, 'param diff 1e-3'\n"
                     "@pytest.mark.skip(reason='needs CUDA')\ndef test_cuda():\n    pass\n")
    plans = plan.build_plan(["d"], "cpu", tmp_path, argparse.Namespace(timeout_d=120))
    cmd = plans[0].worker[:-1] + [str(tests)]
    rows, parts = runner.run_parts([plan.PartPlan("d", "probe", 120, plans[0].checks, cmd)], tmp_path)
    by = {r["id"]: r for r in rows}
    assert [r["id"] for r in rows] == ["d.tests", "d.test_ok", "d.test_bad", "d.test_cuda"]
    assert by["d.test_ok"]["status"] == checks.PASS and by["d.test_ok"]["measured"] == "3 exact"
    assert by["d.test_bad"]["status"] == checks.FAIL and "param diff 1e-3" in by["d.test_bad"]["measured"]
    assert by["d.test_cuda"]["status"] == checks.SKIP and by["d.test_cuda"]["measured"] == "needs CUDA"
    assert by["d.tests"]["status"] == checks.FAIL and by["d.tests"]["measured"] == "3 tests, 1 failed, exit 1"
    assert parts["d"]["rc"] == 1

