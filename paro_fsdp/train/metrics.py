"""What a run reports: one log line per ``log_freq`` steps on rank 0, the same numbers as
TensorBoard scalars and as ``metrics.jsonl`` lines, and torch.profiler traces.

Why these numbers: PaRO trades memory for communication, so next to loss and speed every line
shows the model-state bytes this rank holds (P + G + OS, from the engine) and the bytes the
step moved inside groups (intra) and between groups (inter), from the engine's ledger.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .config import JobConfig

MiB = float(2**20)


def peak_host_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class CommSnapshot:
    intra: float = 0.0
    inter: float = 0.0
    global_: float = 0.0
    count: int = 0


class CommMeter:
    """Per-step deltas of the engine's cumulative communication ledger (``model.comm_stats()``)."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.last = self._now()

    def _now(self) -> CommSnapshot:
        s = self.stats
        return CommSnapshot(s.bytes(dim="intra"), s.bytes(dim="inter"), s.bytes(dim="global"), s.count())

    def delta(self) -> CommSnapshot:
        now = self._now()
        d = CommSnapshot(now.intra - self.last.intra, now.inter - self.last.inter,
                         now.global_ - self.last.global_, now.count - self.last.count)
        self.last = now
        return d


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class MetricsLogger:
    """Rank 0 writes; other ranks only keep the timing state (so every rank can call it)."""

    def __init__(self, cfg: JobConfig, rank: int, device: torch.device, total_steps: int, tokens_per_step: int,
                 world_size: int, run_name: str) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.total_steps, self.tokens_per_step, self.world_size = total_steps, tokens_per_step, world_size
        self.enabled = rank == 0
        self.tb_dir: Optional[str] = None
        self.writer = None
        self.jsonl = None
        self._step_times: list[float] = []
        if not self.enabled:
            return
        dump = cfg.job.dump_folder
        os.makedirs(dump, exist_ok=True)
        self.jsonl = open(os.path.join(dump, "metrics.jsonl"), "a", encoding="utf-8")
        if cfg.metrics.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = os.path.join(dump, cfg.metrics.save_tb_folder, run_name)
            self.writer = SummaryWriter(self.tb_dir)

    def log(self, step: int, loss: float, grad_norm: float, lr: float, step_time: float, comm: CommSnapshot,
            memory: dict[str, int]) -> None:
        """Record one step (call it on every step; it writes on ``log_freq`` steps and the last)."""
        self._step_times.append(step_time)
        if not self.enabled or (step % self.cfg.metrics.log_freq and step != self.total_steps):
            return
        recent = self._step_times[-self.cfg.metrics.log_freq:]
        avg = sum(recent) / len(recent)
        tps = self.tokens_per_step / step_time if step_time > 0 else 0.0
        if self.device.type == "cuda":
            peak, peak_name = torch.cuda.max_memory_allocated(self.device), "cuda_max_allocated"
        else:
            peak, peak_name = peak_host_rss_bytes(), "peak_rss"
        eta = avg * (self.total_steps - step)
        # under torch.compile the ledger sees only collectives run eagerly (the graphs' own are in
        # the compile schedule dump), so say so rather than print a misleading 0
        comm_label = "comm outside graphs" if self.cfg.compile.enable else "comm"
        line = (
            f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} | loss {loss:.4f} | gnorm {grad_norm:.3f} | "
            f"lr {lr:.2e} | {tps:,.0f} tok/s | {step_time:.3f} s/step | "
            f"mem states {_fmt_bytes(memory['total'])} {peak_name.replace('_', ' ')} {_fmt_bytes(peak)} | "
            f"{comm_label} intra {_fmt_bytes(comm.intra)} inter {_fmt_bytes(comm.inter)} | eta {_fmt_eta(eta)}"
        )
        print(line, flush=True)
        scalars = {
            "loss/train": loss,
            "optim/grad_norm": grad_norm,
            "optim/lr": lr,
            "throughput/tokens_per_s": tps,
            "throughput/tokens_per_s_per_rank": tps / self.world_size,
            "time/step_s": step_time,
            "memory/model_states_MiB": memory["total"] / MiB,
            "memory/P_MiB": memory["P"] / MiB,
            "memory/G_MiB": memory["G"] / MiB,
            "memory/OS_MiB": memory["OS"] / MiB,
            f"memory/{peak_name}_MiB": peak / MiB,
            "comm/intra_MiB_per_step": comm.intra / MiB,
            "comm/inter_MiB_per_step": comm.inter / MiB,
            "comm/global_MiB_per_step": comm.global_ / MiB,
            "comm/collectives_per_step": comm.count,
        }
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


def build_profiler(cfg: JobConfig, rank: int, device: torch.device, start_step: int):
    """A torch.profiler that traces one step every ``profile_freq`` steps into
    ``dump_folder/save_traces_folder`` (one ``rank{r}.*.pt.trace.json`` per rank and window),
    or a null context. Call ``.step()`` after every training step."""
    p = cfg.profiling
    if not p.enable_profiling:
        return contextlib.nullcontext(_NoProfiler())
    trace_dir = os.path.join(cfg.job.dump_folder, p.save_traces_folder)
    os.makedirs(trace_dir, exist_ok=True)
    active = 1
    warmup = min(3, p.profile_freq - active)
    wait = p.profile_freq - warmup - active
    warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle.*")
    warnings.filterwarnings("ignore", message=".*Profiler won't be using warmup.*")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, worker_name=f"rank{rank}"),
        record_shapes=True,
    )
    prof.step_num = start_step  # a resumed run keeps tracing the same steps
    return prof


class _NoProfiler:
    def step(self) -> None:
        pass


class StepTimer:
    """Wall time of one step; on CUDA synchronises first so the time covers the kernels."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0
