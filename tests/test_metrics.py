"""The trainer's metrics on CUDA, checked on CPU with a stubbed ``torch.cuda``: MFU arithmetic and
the peak table, the memory numbers and TensorBoard keys of a log line, the allocator's peaks
reset once per log window, and the step timer's CUDA events read (one wait) only at log steps.
On CPU the log line stays as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paro_fsdp.models.llama import flavor
from paro_fsdp.train import metrics as M
from paro_fsdp.train.config import JobConfig

GiB = 2**30
CUDA = torch.device("cuda", 0)


class FakeCuda:
    """What MetricsLogger and StepTimer read from torch.cuda, recorded."""

    def __init__(self, monkeypatch, name: str = "NVIDIA H200") -> None:
        self.calls: list[str] = []
        self.name = name
        self.reserved = 12 * GiB
        for fn in ("get_device_name", "memory_stats", "max_memory_allocated", "memory_reserved",
                   "max_memory_reserved", "reset_peak_memory_stats", "synchronize"):
            monkeypatch.setattr(torch.cuda, fn, getattr(self, fn))
        monkeypatch.setattr(torch.cuda, "Event", self.event_class())

    def get_device_name(self, device=None) -> str:
        self.calls.append("get_device_name")
        return self.name

    def memory_stats(self, device=None) -> dict:
        self.calls.append("memory_stats")
        return {"num_alloc_retries": 3, "allocated_bytes.all.current": 1}

    def max_memory_allocated(self, device=None) -> int:
        self.calls.append("max_memory_allocated")
        return 10 * GiB

    def memory_reserved(self, device=None) -> int:
        self.calls.append("memory_reserved")
        return self.reserved

    def max_memory_reserved(self, device=None) -> int:
        self.calls.append("max_memory_reserved")
        return 14 * GiB

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset_peak_memory_stats")

    def synchronize(self, device=None) -> None:
        self.calls.append("synchronize")

    def event_class(self):
        fake = self

        class Event:
            clock = 0.0

            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t = None

            def record(self, stream=None) -> None:
                fake.calls.append("Event.record")
                Event.clock += 0.25  # ms of GPU time between consecutive records
                self.t = Event.clock

            def synchronize(self) -> None:
                fake.calls.append("Event.synchronize")

            def elapsed_time(self, end) -> float:
                fake.calls.append("Event.elapsed_time")
                return end.t - self.t

        return Event


def _cfg(tmp_path: Path, log_freq: int = 2) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.metrics.log_freq = log_freq
    cfg.metrics.enable_tensorboard = False
    return cfg


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[int, dict[str, float]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.setdefault(step, {})[tag] = value

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


MEMORY = {"P": 1 * GiB, "G": 2 * GiB, "OS": 3 * GiB, "total": 6 * GiB}
COMM = M.CommSnapshot(intra=2**20, inter=2**21, global_=0.0, count=4)


def _run_logger(logger: M.MetricsLogger, steps: int, seconds: float = 0.5) -> None:
    """The trainer's calls: begin_window before the first step, log at log steps only."""
    logger.begin_window()
    window: list[float] = []
    for step in range(1, steps + 1):
        window.append(seconds)
        if logger.should_log(step):
            logger.log(step, 2.5, 1.25, 1e-4, window, COMM, MEMORY)
            window = []


def test_flops_per_token_and_mfu_arithmetic():
    a = flavor("llama7b")
    fpt = M.flops_per_token(a.num_params(), a.n_layers, a.dim, 2048, a.vocab_size * a.dim)
    # 6 * (6.74e9 - 0.13e9 embedding) + 12 * 32 * 4096 * 2048
    assert fpt == 6 * (a.num_params() - 32000 * 4096) + 12 * 32 * 4096 * 2048
    assert fpt == pytest.approx(4.289e10, rel=1e-3)
    assert M.flops_per_token(100, 2, 8, 16) == 600 + 12 * 2 * 8 * 16


def test_peak_table_and_override(monkeypatch):
    FakeCuda(monkeypatch, "NVIDIA H200")
    monkeypatch.delenv(M.PEAK_TFLOPS_ENV, raising=False)
    assert M.peak_flops(CUDA, torch.bfloat16) == pytest.approx(989e12)
    assert M.peak_flops(CUDA, torch.float32) == pytest.approx(66.9e12)  # plain fp32 unless TF32 is allowed
    prec = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert M.peak_flops(CUDA, torch.float32) == pytest.approx(494.7e12)
    finally:
        torch.set_float32_matmul_precision(prec)
    FakeCuda(monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert M.peak_flops(CUDA, torch.bfloat16) == pytest.approx(312e12)
    FakeCuda(monkeypatch, "NVIDIA H100 PCIe")
    assert M.peak_flops(CUDA, torch.bfloat16) == pytest.approx(756e12)
    FakeCuda(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert M.peak_flops(CUDA, torch.bfloat16) == pytest.approx(989e12)
    FakeCuda(monkeypatch, "Tesla V100-SXM2-16GB")
    assert M.peak_flops(CUDA, torch.bfloat16) is None  # unknown: no MFU
    monkeypatch.setenv(M.PEAK_TFLOPS_ENV, "125")
    assert M.peak_flops(CUDA, torch.bfloat16) == pytest.approx(125e12)
    assert M.peak_flops(torch.device("cpu"), torch.bfloat16) is None  # CUDA only
    monkeypatch.setenv(M.PEAK_TFLOPS_ENV, "fast")
    with pytest.raises(ValueError, match="PARO_PEAK_TFLOPS"):
        M.peak_flops(CUDA, torch.bfloat16)


def test_cuda_log_line_scalars_and_peak_reset_per_window(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(M.PEAK_TFLOPS_ENV, raising=False)
    fake = FakeCuda(monkeypatch, "NVIDIA H200")
    fpt = 1e9
    logger = M.MetricsLogger(_cfg(tmp_path, log_freq=2), 0, CUDA, 5, 4000, 2, "run", flops_per_token=fpt,
                             param_dtype=torch.bfloat16)
    logger.writer = FakeWriter()
    fake.calls.clear()
    _run_logger(logger, 5)
    logger.close()
    # the peaks restart at the start of each window (steps 1-2, 3-4, 5): three resets, each
    # before the window's reads
    assert fake.calls.count("reset_peak_memory_stats") == 3
    reads = [c for c in fake.calls if c in ("max_memory_allocated", "reset_peak_memory_stats")]
    assert reads == ["reset_peak_memory_stats", "max_memory_allocated"] * 3
    assert "synchronize" not in fake.calls
    mfu = 100 * fpt * (4000 / 0.5) / (989e12 * 2)
    for step in (2, 4, 5):
        s = logger.writer.scalars[step]
        assert s["throughput/mfu_pct"] == pytest.approx(mfu)
        assert s["memory/cuda_max_allocated_MiB"] == 10 * 1024
        assert s["memory/cuda_reserved_MiB"] == 12 * 1024
        assert s["memory/cuda_max_reserved_MiB"] == 14 * 1024
        assert s["memory/cuda_alloc_retries"] == 3
        assert "memory/peak_rss_MiB" not in s
    assert sorted(logger.writer.scalars) == [2, 4, 5]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4, 5] and lines[0]["throughput/mfu_pct"] == pytest.approx(mfu)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3
    assert f"mfu {mfu:.1f}%" in out[0]
    assert "cuda max allocated 10.00 GiB reserved 12.00 GiB (max 14.00 GiB) alloc retries 3" in out[0]


def test_cuda_unknown_gpu_logs_no_mfu_and_other_ranks_read_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(M.PEAK_TFLOPS_ENV, raising=False)
    fake = FakeCuda(monkeypatch, "Some Future GPU")
    logger = M.MetricsLogger(_cfg(tmp_path), 0, CUDA, 2, 4000, 1, "run", flops_per_token=1e9,
                             param_dtype=torch.bfloat16)
    logger.writer = FakeWriter()
    _run_logger(logger, 2)
    assert "throughput/mfu_pct" not in logger.writer.scalars[2]
    assert "mfu" not in capsys.readouterr().out
    fake.calls.clear()
    other = M.MetricsLogger(_cfg(tmp_path / "r1"), 1, CUDA, 4, 4000, 2, "run", flops_per_token=1e9)
    _run_logger(other, 4)
    assert [c for c in fake.calls if c != "get_device_name"] == []


def test_cpu_line_unchanged(tmp_path, capsys):
    logger = M.MetricsLogger(_cfg(tmp_path, log_freq=2), 0, torch.device("cpu"), 3, 1000, 2, "run", flops_per_token=1e9)
    logger.writer = FakeWriter()
    _run_logger(logger, 3, seconds=0.5)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 2/3 | loss 2.5000 | gnorm 1.250 | lr 1.00e-04 | 2,000 tok/s | 0.500 s/step | "
                             "mem states 6.00 GiB peak rss ")
    assert out[0].endswith("| comm intra 1.00 MiB inter 2.00 MiB | eta 0:00:00")
    assert "mfu" not in out[0] and "reserved" not in out[0]
    assert set(logger.writer.scalars[2]) == {
        "loss/train", "optim/grad_norm", "optim/lr", "throughput/tokens_per_s", "throughput/tokens_per_s_per_rank",
        "time/step_s", "memory/model_states_MiB", "memory/P_MiB", "memory/G_MiB", "memory/OS_MiB",
        "memory/peak_rss_MiB", "comm/intra_MiB_per_step", "comm/inter_MiB_per_step", "comm/global_MiB_per_step",
        "comm/collectives_per_step", "host/rss_MiB", "host/open_files"}
    host = logger.writer.scalars[2]
    assert host["host/rss_MiB"] > 10 and host["host/open_files"] >= 3  # this process now


def test_step_timer_reads_cuda_events_once_per_window(monkeypatch):
    fake = FakeCuda(monkeypatch)
    timer = M.StepTimer(CUDA)
    for _ in range(3):
        timer.start()
        timer.stop()
    assert fake.calls == ["Event.record"] * 6  # no wait, no read while the steps run
    times = timer.collect()
    assert fake.calls[6:] == ["Event.synchronize"] + ["Event.elapsed_time"] * 3
    assert times == pytest.approx([0.25e-3] * 3)  # elapsed_time is in ms
    assert timer.collect() == [] and fake.calls.count("Event.synchronize") == 1


def test_step_timer_on_cpu_is_host_time():
    timer = M.StepTimer(torch.device("cpu"))
    timer.start()
    timer.stop()
    timer.start()
    timer.stop()
    times = timer.collect()
    assert len(times) == 2 and all(0 <= t < 1 for t in times) and timer.collect() == []
