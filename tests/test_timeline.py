"""The step timeline (paro_fsdp/train/timeline.py) on synthetic traces: rows, the busy and
overlap fractions, intra vs inter told apart by gloo worker thread (CPU) or by the process-group
args of NCCL kernels (CUDA), the image, and what the writer puts in TensorBoard. A real trace
through the trainer is checked in test_trainer.py (test_timeline_images_in_tensorboard)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from paro_fsdp.train import timeline as T

MAIN, INTRA_T, INTER_T = 1, 10, 20


def ev(name: str, ts: float, end: float, tid: int = MAIN, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": end - ts, "args": args}


def cpu_trace() -> dict:
    """A 10 ms step (us 1000..11000): compute 1-4, 5-9 ms with a wait at 6-7 ms inside it; an intra
    all-gather on its worker thread 3-6.5 ms, an inter all-reduce 8-12 ms (past the step's end)."""
    return {"traceEvents": [
        ev("ProfilerStep#4", 1000, 11000, cat="user_annotation"),
        ev("aten::mm", 1000, 4000),
        ev("_c10d_functional::all_gather_into_tensor", 4000, 4100),
        ev("autograd::engine::evaluate_function: MmBackward0", 5000, 9000),
        ev("_c10d_functional::wait_tensor", 6000, 7000),
        ev("gloo:all_gather", 3000, 6500, tid=INTRA_T, cat="user_annotation"),
        ev("aten::copy_", 3100, 3200, tid=INTRA_T),  # inside the collective: not compute
        ev("gloo:all_reduce", 8000, 12000, tid=INTER_T, cat="user_annotation"),
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": MAIN, "args": {"name": "python"}},
    ]}


def test_cpu_rows_and_fractions():
    tl = T.parse(cpu_trace(), {INTRA_T: "intra", INTER_T: "inter"})
    assert tl.step == 4 and tl.duration == pytest.approx(10.0)
    assert tl.rows["compute"] == [(0.0, 3.0), (4.0, 5.0), (6.0, 8.0)]  # the issue call and the wait are not compute
    assert tl.rows["wait"] == [(5.0, 6.0)]
    assert tl.rows["intra"] == [(2.0, 5.5)]
    assert tl.rows["inter"] == [(7.0, 10.0)]  # clipped to the step
    assert tl.rows["global"] == tl.rows["other"] == []
    f = T.fractions(tl)
    # collectives run 3.5 + 3 ms; compute runs during 1 + 1 ms of the intra one and 1 ms of the inter one
    assert f["overlap_fraction"] == pytest.approx(3.0 / 6.5)
    assert f["inter_busy_fraction"] == pytest.approx(0.3)
    assert f["intra_busy_fraction"] == pytest.approx(0.35)
    assert f["compute_fraction"] == pytest.approx(0.6)


def test_cpu_unknown_thread_is_other_and_dims_follow_the_thread_map():
    tl = T.parse(cpu_trace(), {INTRA_T: "inter"})  # the map decides, not the op's name
    assert tl.rows["inter"] == [(2.0, 5.5)] and tl.rows["other"] == [(7.0, 10.0)] and tl.rows["intra"] == []
    assert T.fractions(tl)["overlap_fraction"] == pytest.approx(3.0 / 6.5)  # "other" still counts as a collective


def test_cuda_kernels_classified_by_process_group_args():
    names = {"5": "intra", "6": "inter"}
    trace = {"traceEvents": [
        ev("ProfilerStep#0", 0, 4000, cat="user_annotation"),
        ev("aten::mm", 0, 100),  # host ops do not count on a GPU: kernels do
        ev("sm90_gemm_kernel", 500, 2500, tid=7, cat="kernel"),
        ev("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1000, 2000, tid=20, cat="kernel",
           **{"Process Group Name": "5", "Process Group Description": "mesh_intra"}),
        ev("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 2000, 3000, tid=21, cat="kernel",
           **{"Process Group Name": "99", "Process Group Description": "mesh_inter"}),  # by description
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 3000, 3500, tid=21, cat="kernel"),  # no args: other
        ev("triton_poi_fused_add_0", 4500, 5000, tid=7, cat="kernel"),  # queued in the step, ran after its host range
    ]}
    tl = T.parse(trace, {}, names)
    assert tl.duration == pytest.approx(5.0)
    assert tl.rows["compute"] == [(0.5, 2.5), (4.5, 5.0)]
    assert tl.rows["intra"] == [(1.0, 2.0)] and tl.rows["inter"] == [(2.0, 3.0)] and tl.rows["other"] == [(3.0, 3.5)]
    f = T.fractions(tl)
    assert f["overlap_fraction"] == pytest.approx(1.5 / 2.5)
    assert f["inter_busy_fraction"] == pytest.approx(0.2)


def test_a_paused_stretch_is_cut_out_of_rows_duration_and_fractions():
    """profiling.traced_micro_steps: the profiler paused over the middle micro-steps of a 20 ms step
    (its pause and resume marks at 4 and 14 ms). The intra all-gather issued before the pause ran to
    6 ms: the cut starts there, so 8 ms are cut and the step's traced time is 12 ms."""
    trace = {"traceEvents": [
        ev("ProfilerStep#4", 0, 20000, cat="user_annotation"),
        ev("aten::mm", 1000, 3000),  # the first micro-step
        ev("gloo:all_gather", 2500, 6000, tid=INTRA_T, cat="user_annotation"),
        ev("paro::pause#2", 4000, 4010, cat="user_annotation"),
        ev("paro::resume", 14000, 14010, cat="user_annotation"),
        ev("aten::mm", 15000, 17000),  # the last micro-step, then the boundary's inter all-reduce
        ev("gloo:all_reduce", 16000, 19000, tid=INTER_T, cat="user_annotation"),
    ]}
    tl = T.parse(trace, {INTRA_T: "intra", INTER_T: "inter"})
    assert tl.duration == pytest.approx(12.0) and tl.cuts == [(pytest.approx(6.0), 2)]
    assert tl.rows["compute"] == [(1.0, 3.0), (7.0, 9.0)]  # the marks are not compute
    assert tl.rows["intra"] == [(2.5, 6.0)] and tl.rows["inter"] == [(8.0, 11.0)] and tl.rows["wait"] == []
    f = T.fractions(tl)
    assert f["compute_fraction"] == pytest.approx(4 / 12) and f["inter_busy_fraction"] == pytest.approx(3 / 12)
    assert f["intra_busy_fraction"] == pytest.approx(3.5 / 12) and f["overlap_fraction"] == pytest.approx(1.5 / 6.5)


def test_a_paused_stretch_on_a_gpu_starts_when_its_last_kernel_ends(monkeypatch):
    """The GPU runs behind the host: a kernel launched before the pause mark ran on past it."""
    from matplotlib.axes import Axes

    trace = {"traceEvents": [
        ev("ProfilerStep#0", 0, 20000, cat="user_annotation"),
        ev("paro::pause#62", 3000, 3010, cat="user_annotation"),
        ev("paro::resume", 12000, 12010, cat="user_annotation"),
        ev("sm90_gemm_kernel", 1000, 5000, tid=7, cat="kernel"),
        ev("sm90_gemm_kernel", 13000, 15000, tid=7, cat="kernel"),
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 14000, 16000, tid=21, cat="kernel",
           **{"Process Group Description": "mesh_inter"}),
    ]}
    tl = T.parse(trace)
    assert tl.duration == pytest.approx(13.0) and tl.cuts == [(pytest.approx(5.0), 62)]
    assert tl.rows["compute"] == [(1.0, 5.0), (6.0, 8.0)] and tl.rows["inter"] == [(7.0, 9.0)]
    lines, axvline = [], Axes.axvline
    monkeypatch.setattr(Axes, "axvline", lambda self, x, *a, **k: lines.append(x) or axvline(self, x, *a, **k))
    T.render(tl, "rank 0 | step 1 | eager")
    assert lines == [pytest.approx(5.0)]  # the cut is marked


def test_closing_trace_without_work_is_skipped():
    empty = {"traceEvents": [ev("ProfilerStep#3", 0, 50, cat="user_annotation")]}
    assert T.parse(empty) is None
    assert T.parse({"traceEvents": []}) is None


def test_group_dims_follow_the_mesh_shape():
    names = {"intra": "3", "inter": "1", "global": "4"}
    assert T.group_dims(SimpleNamespace(g=2, m=2, group_names=names), "0") == {
        "0": "global",
        "4": "global",
        "3": "intra",
        "1": "inter",
    }
    # one group: the flat collectives only cross the intra link; one rank per group: only the inter one
    assert T.group_dims(SimpleNamespace(g=1, m=4, group_names=names), "0") == {"0": "intra", "4": "intra", "3": "intra"}
    assert T.group_dims(SimpleNamespace(g=4, m=1, group_names=names), "0") == {"0": "inter", "4": "inter", "1": "inter"}


def _has(image: np.ndarray, color: str) -> bool:
    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
    return bool((np.abs(image.astype(int) - rgb).sum(axis=-1) < 10).any())


def test_render_draws_every_row_that_occurs():
    tl = T.parse(cpu_trace(), {INTRA_T: "intra", INTER_T: "inter"})
    image = T.render(tl, "rank 0 | step 5 | eager")
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.shape[1] == 1200
    for row in ("compute", "intra", "inter", "wait"):
        assert _has(image, T.COLORS[row]), row
    assert not _has(image, T.COLORS["global"])


def test_writer_puts_image_and_scalars_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = tmp_path / "rank0.1.pt.trace.json"
    path.write_text(json.dumps(cpu_trace()))
    empty = tmp_path / "rank0.2.pt.trace.json"
    empty.write_text(json.dumps({"traceEvents": [ev("ProfilerStep#5", 0, 50, cat="user_annotation")]}))
    w = T.TimelineWriter(str(tmp_path / "tb"), 0, "eager", {INTRA_T: "intra", INTER_T: "inter"}, {})
    w(str(path))
    w(str(empty))
    w(str(tmp_path / "missing.json"))  # reported, never raised
    w.close()
    assert w.written == [5]  # ProfilerStep#4 is trainer step 5
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["timeline/rank0"]
    assert [e.step for e in acc.Images("timeline/rank0")] == [5]
    values = {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"]}
    assert values["timeline/overlap_fraction"] == pytest.approx(3.0 / 6.5)
    assert values["timeline/inter_busy_fraction"] == pytest.approx(0.3)


def test_writer_parses_in_its_own_process_not_on_the_training_thread(tmp_path, monkeypatch):
    """A 64-micro-step 7B trace is about a GB whose json.load holds the GIL for tens of seconds
    (tools/bench/profile_cost.py): the profiler's sink only starts the drawing, which still lands."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    here, parse = [], T.parse
    monkeypatch.setattr(T, "parse", lambda *a, **k: here.append(1) or parse(*a, **k))
    path = tmp_path / "rank3.1.pt.trace.json"
    path.write_text(json.dumps(cpu_trace()))
    w = T.TimelineWriter(str(tmp_path / "tb"), 3, "eager", {INTRA_T: "intra", INTER_T: "inter"}, {})
    w(str(path))
    assert here == [] and w.written == []
    w.close()
    assert here == [] and w.written == [5]
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("timeline/rank3")] == [5]
    want = T.fractions(parse(cpu_trace(), {INTRA_T: "intra", INTER_T: "inter"}))["intra_busy_fraction"]
    assert acc.Scalars("timeline/intra_busy_fraction")[0].value == pytest.approx(want)


def test_subtract_is_one_sweep_at_a_7b_steps_size():
    """A 64-micro-step 7B step: millions of ops, tens of thousands of collective calls; a pairwise
    subtraction (the ops times the calls) would never finish drawing it."""
    ops = [(float(i), i + 0.7) for i in range(20000)]
    calls = [(i + 0.5, i + 0.8) for i in range(20000)]
    t0 = time.perf_counter()
    out = T.subtract(ops, calls)
    assert time.perf_counter() - t0 < 1.0
    assert out == [(float(i), i + 0.5) for i in range(20000)]
    assert T.subtract([(0, 10)], [(1, 2), (3, 4), (9, 12)]) == [(0, 1), (2, 3), (4, 9)]


def test_render_draws_at_most_a_bar_per_pixel(monkeypatch):
    from matplotlib.axes import Axes

    bars, draw = [], Axes.broken_barh
    monkeypatch.setattr(Axes, "broken_barh", lambda self, xr, *a, **k: bars.append(len(xr)) or draw(self, xr, *a, **k))
    ops = [(i * 0.01, i * 0.01 + 0.005) for i in range(100000)]  # 1000 ms of sub-pixel ops and gaps
    tl = T.Timeline(1, 1000.0, {r: ops if r == "compute" else [(500.0, 600.0)] if r == "inter" else [] for r in T.ROWS})
    image = T.render(tl, "rank 0 | step 2 | eager")
    assert max(bars) <= 1200 and sum(bars) >= 2
    assert _has(image, T.COLORS["compute"]) and _has(image, T.COLORS["inter"])
