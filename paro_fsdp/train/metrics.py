"""What a run reports: a log line per ``log_freq`` steps on rank 0, the same numbers as
TensorBoard scalars and ``metrics.jsonl`` lines, and torch.profiler traces.

Why these numbers: PaRO trades memory for communication, so each line shows this rank's
model-state bytes (P + G + OS) and the bytes the step moved intra and inter group. On CUDA
nothing waits for the GPU between log steps: loss, grad norm and timing events are read once per window.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..dtypes import dtype_of
from .config import JobConfig
from .data import describe
from .timeline import PAUSE_MARK, RESUME_MARK, TimelineWriter, gloo_threads, group_dims

MiB = float(2**20)

# Dense peak TFLOP/s per GPU by a substring of its name, the first match winning (specific names
# first); "fp32" is matmul precision "highest", "tf32" when set_float32_matmul_precision allows it.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989.0, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.0, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
)
PEAK_TFLOPS_ENV = "PARO_PEAK_TFLOPS"  # overrides one GPU's peak TFLOP/s for the run's dtype (or corrects the table)


def host_now() -> dict[str, float]:
    """Resident memory and open fds now: a long run's leak shows as a slope (Linux /proc; empty elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return {"host/rss_MiB": rss_pages * os.sysconf("SC_PAGE_SIZE") / MiB,
                "host/open_files": len(os.listdir("/proc/self/fd"))}
    except (OSError, ValueError):
        return {}


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


def flops_per_token(params: int, n_layers: int, dim: int, seq_len: int, embedding_params: int = 0) -> float:
    """Forward + backward FLOPs per token: 6 per matmul weight (embedding lookups left out, as torchtitan and the
    advisor do) plus attention's 12 * n_layers * dim * seq_len."""
    return 6.0 * (params - embedding_params) + 12.0 * n_layers * dim * seq_len


def peak_flops(device: torch.device, param_dtype: torch.dtype) -> Optional[float]:
    """One GPU's dense peak FLOP/s: ``$PARO_PEAK_TFLOPS``, else ``PEAK_TFLOPS``; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    override = os.environ.get(PEAK_TFLOPS_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            raise ValueError(f"${PEAK_TFLOPS_ENV} = {override!r} is not a number; valid: one GPU's peak TFLOP/s, "
                             f"e.g. 989") from None
        return value * 1e12 if value > 0 else None
    name = torch.cuda.get_device_name(device)
    highest = torch.get_float32_matmul_precision() == "highest"
    kind = "bf16" if param_dtype in (torch.bfloat16, torch.float16) else "fp32" if highest else "tf32"
    return next((peaks[kind] * 1e12 for key, peaks in PEAK_TFLOPS if key in name), None)


def cuda_memory(device: torch.device) -> dict[str, float]:
    """The allocator's window peaks, reserved now and cudaMalloc retries; host-side reads, no sync."""
    stats = torch.cuda.memory_stats(device)
    return {"cuda_max_allocated": float(torch.cuda.max_memory_allocated(device)),
            "cuda_reserved": float(torch.cuda.memory_reserved(device)),
            "cuda_max_reserved": float(torch.cuda.max_memory_reserved(device)),
            "cuda_alloc_retries": float(stats.get("num_alloc_retries", 0))}


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_eta(seconds: float) -> str:
    h, rem = divmod(int(max(seconds, 0)), 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class MetricsLogger:
    """Rank 0 writes; other ranks only keep the timing state (so every rank can call it)."""

    def __init__(self, cfg: JobConfig, rank: int, device: torch.device, total_steps: int, tokens_per_step: int,
                 world_size: int, run_name: str, flops_per_token: float = 0.0,
                 param_dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.rank, self.device, self.run_name = cfg, rank, device, run_name
        self.total_steps, self.tokens_per_step, self.world_size = total_steps, tokens_per_step, world_size
        self.enabled = rank == 0
        self.tb_dir: Optional[str] = None
        self.writer = None
        self.jsonl = None
        self._step_times: list[float] = []
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops(device, param_dtype) if flops_per_token > 0 else None
        if not self.enabled:
            return
        dump = cfg.job.dump_folder
        os.makedirs(dump, exist_ok=True)
        self.jsonl = open(os.path.join(dump, "metrics.jsonl"), "a", encoding="utf-8")
        if cfg.metrics.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = os.path.join(dump, cfg.metrics.save_tb_folder, run_name)
            self.writer = SummaryWriter(self.tb_dir)

    def should_log(self, step: int) -> bool:
        """Whether ``step`` ends a log window (every ``log_freq`` steps, and the last step)."""
        return step % self.cfg.metrics.log_freq == 0 or step == self.total_steps

    def begin_window(self) -> None:
        """Start a log window: on CUDA the allocator's peaks restart from the current usage."""
        if self.enabled and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def log(self, step: int, loss: float, grad_norm: float, lr: float, step_times: list[float], comm: CommSnapshot,
            memory: dict[str, int]) -> None:
        """Log step ``step`` if ``should_log``; ``step_times``: this window's step seconds (``StepTimer.collect``)."""
        self._step_times.extend(step_times)
        if not self.enabled or not self.should_log(step):
            return
        recent = self._step_times[-self.cfg.metrics.log_freq:]
        avg = sum(recent) / len(recent)
        step_time = step_times[-1] if step_times else avg
        tps = self.tokens_per_step / step_time if step_time > 0 else 0.0
        cuda = cuda_memory(self.device) if self.device.type == "cuda" else None
        peak_name = "cuda_max_allocated" if cuda else "peak_rss"
        peak = cuda["cuda_max_allocated"] if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB
        mfu = 100.0 * self.flops_per_token * tps / (self.peak_flops * self.world_size) if self.peak_flops else None
        eta = avg * (self.total_steps - step)
        # under torch.compile the ledger sees only eager collectives: say so rather than print a misleading 0
        comm_label = "comm outside graphs" if self.cfg.compile.enable else "comm"
        cuda_text = (f" reserved {_fmt_bytes(cuda['cuda_reserved'])} (max {_fmt_bytes(cuda['cuda_max_reserved'])}) "
                     f"alloc retries {cuda['cuda_alloc_retries']:.0f}") if cuda is not None else ""
        mfu_text = f" | mfu {mfu:.1f}%" if mfu is not None else ""
        print(f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} | loss {loss:.4f} | "
              f"gnorm {grad_norm:.3f} | lr {lr:.2e} | {tps:,.0f} tok/s{mfu_text} | {step_time:.3f} s/step | "
              f"mem states {_fmt_bytes(memory['total'])} {peak_name.replace('_', ' ')} {_fmt_bytes(peak)}{cuda_text} | "
              f"{comm_label} intra {_fmt_bytes(comm.intra)} inter {_fmt_bytes(comm.inter)} | eta {_fmt_eta(eta)}",
              flush=True)
        scalars = {"loss/train": loss, "optim/grad_norm": grad_norm, "optim/lr": lr,
                   "throughput/tokens_per_s": tps, "throughput/tokens_per_s_per_rank": tps / self.world_size,
                   "time/step_s": step_time, "memory/model_states_MiB": memory["total"] / MiB,
                   **{f"memory/{k}_MiB": memory[k] / MiB for k in ("P", "G", "OS")},
                   f"memory/{peak_name}_MiB": peak / MiB,
                   "comm/intra_MiB_per_step": comm.intra / MiB, "comm/inter_MiB_per_step": comm.inter / MiB,
                   "comm/global_MiB_per_step": comm.global_ / MiB, "comm/collectives_per_step": comm.count}
        scalars.update(host_now())
        if mfu is not None:
            scalars["throughput/mfu_pct"] = mfu
        if cuda is not None:
            scalars.update({f"memory/{k}_MiB": cuda[k] / MiB for k in ("cuda_reserved", "cuda_max_reserved")})
            scalars["memory/cuda_alloc_retries"] = cuda["cuda_alloc_retries"]
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            self.jsonl.flush()
        if step < self.total_steps:
            self.begin_window()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


def build_metrics(cfg: JobConfig, rank: int, device: torch.device, model: torch.nn.Module, args: Any,
                  tokens_per_step: int, world_size: int, shared_run: bool) -> MetricsLogger:
    """The run's logger, its TensorBoard run named by the start time (``shared_run``: rank 0's, for every rank)."""
    names = [time.strftime("%Y%m%d-%H%M%S")]
    if shared_run:
        dist.broadcast_object_list(names, src=0)
    t = cfg.training
    fpt = flops_per_token(sum(p.numel() for p in model.parameters()), args.n_layers, args.dim, t.seq_len,
                          args.vocab_size * args.dim)
    return MetricsLogger(cfg, rank, device, t.steps, tokens_per_step, world_size, names[0], flops_per_token=fpt,
                         param_dtype=dtype_of(t.mixed_precision_param))


def startup_lines(trainer: Any) -> list[str]:
    """What rank 0 logs once the trainer is built: world and strategy, model, batch, data, and where it starts."""
    cfg, a, t, ckpt = trainer.cfg, trainer.model_args, trainer.cfg.training, trainer.checkpointer
    world, group, model = trainer.world_size, trainer.group_size, trainer.model
    n_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    strategies = sorted({str(s) for s in model.paro_strategies().values()})
    if cfg.model.name == "hf":
        from ..integrations.hf import architecture

        what = f"hf {cfg.model.hf_path} ({architecture(model)})"
    else:
        what = f"{cfg.model.name}/{cfg.model.flavor}"
    lora = (f", LoRA rank {cfg.peft.lora_rank} on {cfg.peft.target_modules or 'peft default targets'}"
            if cfg.peft.lora_rank else "")
    q = cfg.parallelism.inter_dtype
    wire = "" if q == "none" else f", between groups {q} ({'grads int4, params int8' if q == 'int4' else 'quantized'})"
    lines = [f"{cfg.job.description} | world {world} = {world // group} groups x {group} | strategy "
             f"{', '.join(strategies)} | {dist.get_backend()} on {trainer.device.type}",
             f"model {what}: {n_params / 1e6:,.2f}M params, {trainable:,} of them trained "
             f"({100 * trainable / n_params:.2f}%{lora}), vocab {a.vocab_size}, seq {t.seq_len} | params "
             f"{t.mixed_precision_param}, grads {t.mixed_precision_reduce} (accumulated in "
             f"{t.mixed_precision_accumulate}), master fp32{wire} | activation checkpoint "
             f"{cfg.activation_checkpoint.mode}",
             f"batch {t.local_batch_size} per rank x {world} ranks x {trainer.grad_accum} accumulation = "
             f"{t.local_batch_size * world * trainer.grad_accum} sequences = {trainer.tokens_per_step:,} tokens per "
             f"step",
             f"data: {describe(trainer.data, t.dataset, t.dataset_path)}"]
    if trainer.fresh_removed:
        lines.append(f"job.fresh: removed the previous run's {', '.join(trainer.fresh_removed)}")
    lines += [f"removed {ckpt.folder}/{name}: a save or prune that did not finish (the run stopped while writing it)"
              for name in ckpt.removed]
    lines += ckpt.notes  # damaged folders moved aside, later steps a resume replaces
    if trainer.resumed_from is not None:
        lines.append(f"resumed from {ckpt.folder}/step-{trainer.resumed_from}")
    elif trainer.initial_load:
        lines.append(f"started from {trainer.initial_load} in {cfg.checkpoint.initial_load_path} (optimizer, lr "
                     f"schedule and data from step 0)")
    elif cfg.checkpoint.enable:
        lines.append(f"no checkpoint in {ckpt.folder}: starting from step 0")
    return lines


def where_to_look(cfg: JobConfig, tb_dir: Optional[str], timeline: bool) -> list[str]:
    """The end of a run: where its logs, traces and timelines are, and the command that opens them."""
    dump = os.path.abspath(cfg.job.dump_folder)
    tb_bin = Path(sys.executable).parent / "tensorboard"
    tb = str(tb_bin) if tb_bin.exists() else "tensorboard"
    lines = []
    if tb_dir:
        lines += [f"TensorBoard logs: {os.path.abspath(tb_dir)}",
                  f"open them with:   {tb} --logdir {dump} --port 6006   then browse http://localhost:6006"]
    if cfg.profiling.enable_profiling:
        traces = os.path.join(dump, cfg.profiling.save_traces_folder)
        lines.append(f"profiler traces:  {traces} (open a rank*.pt.trace.json in Perfetto or chrome://tracing; "
                     f"TensorBoard's torch-tb-profiler tab lists them but draws its charts only with internet access)")
        if timeline:
            lines.append("step timelines:   TensorBoard's Images tab, timeline/rank<r> (runs <run>/timeline_rank<r>), "
                         "and the timeline/overlap_fraction and timeline/inter_busy_fraction scalars")
    return lines + [f"metrics per logged step: {os.path.join(dump, 'metrics.jsonl')}"]


def timeline_writer(cfg: JobConfig, model: Any, rank: int, device: torch.device, run_name: str) -> TimelineWriter:
    """``profiling.timeline``'s sink into ``<run>/timeline_rank<r>``. On gloo it first learns the worker
    threads of each mesh dimension (``gloo_threads``: collectives, so every rank calls it)."""
    dims = group_dims(model.paro_mesh_groups(), dist.group.WORLD.group_name)
    threads = gloo_threads(dims) if device.type == "cpu" else {}
    log_dir = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder, run_name, f"timeline_rank{rank}")
    # ProfilerStep#N runs while the profiler's step_num is N: trainer step N + 1 (build_profiler)
    return TimelineWriter(log_dir, rank, "compiled" if cfg.compile.enable else "eager", threads, dims)


def build_profiler(cfg: JobConfig, rank: int, device: torch.device, start_step: int,
                   on_trace: Optional[Callable[[str], None]] = None):
    """A ``StepProfiler`` tracing one step every ``profile_freq`` (each rank's newest ``keep_latest_k`` kept), or
    a null context; ``on_trace(path)`` gets each trace."""
    p = cfg.profiling
    if not p.enable_profiling:
        return contextlib.nullcontext(NO_PROFILER)
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

    def trace_ready(prof: Any) -> None:  # torch's tensorboard_trace_handler, plus on_trace
        path = os.path.join(trace_dir, f"rank{rank}.{time.time_ns()}.pt.trace.json")
        prof.export_chrome_trace(path)
        if p.keep_latest_k:  # bounded: this rank's newest k traces (one step each)
            mine = sorted((f for f in os.listdir(trace_dir) if f.startswith(f"rank{rank}.")
                           and f.endswith(".pt.trace.json")),
                          key=lambda f: int(f.split(".")[1]) if f.split(".")[1].isdigit() else 0)
            for old in mine[:-p.keep_latest_k]:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(trace_dir, old))
        if on_trace is not None:
            on_trace(path)

    # No shapes: the timeline needs none, and they make the stop and export that block the training thread
    # 2.6x slower and the trace 1.5x larger (python -m tools.bench.profile_cost)
    prof = StepProfiler(p.traced_micro_steps, schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active),
                        activities=activities, on_trace_ready=trace_ready, record_shapes=False)
    prof.step_num = start_step  # a resumed run keeps tracing the same steps
    return prof


# Every kind torch can toggle: CPU alone or with CUDA logs a C++ warning at each toggle (torch's check wants both
# CUDA and XPU to stay quiet); the GPU kinds flip one switch of kineto's, a no-op on a CPU run
_TOGGLED = (torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA,
            torch.profiler.ProfilerActivity.XPU)
_RECORDING = (torch.profiler.ProfilerAction.RECORD, torch.profiler.ProfilerAction.RECORD_AND_SAVE)


class StepProfiler(torch.profiler.profile):
    """torch's profiler recording, in a traced step, only the first ``traced - 1`` micro-steps and the last (the
    boundary): its stop and export hold the training thread for time that grows with its events. The marks
    ``paro::pause#<skipped>`` / ``paro::resume`` let the timeline cut the untraced time out."""

    def __init__(self, traced: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.traced = traced  # 0: every micro-step
        self.paused = False

    def micro_step(self, micro: int, grad_accum: int) -> None:
        """At the start of micro-step ``micro`` (0-based): pauses or resumes collection in a traced step."""
        if not self.traced or grad_accum <= self.traced or self.current_action not in _RECORDING:
            return
        if micro == self.traced - 1:
            with torch.profiler.record_function(f"{PAUSE_MARK}{grad_accum - self.traced}"):
                pass
            self.toggle_collection_dynamic(False, _TOGGLED)
            self.paused = True
        elif micro == grad_accum - 1:
            self._resume()

    def _resume(self) -> None:
        if self.paused:
            self.toggle_collection_dynamic(True, _TOGGLED)
            self.paused = False
            with torch.profiler.record_function(RESUME_MARK):
                pass

    def step(self) -> None:
        self._resume()  # a step that never reached its last micro-step must not leave the next one paused
        super().step()


class _NoProfiler:
    def step(self) -> None:
        pass

    def micro_step(self, micro: int, grad_accum: int) -> None:
        pass


NO_PROFILER = _NoProfiler()


class StepTimer:
    """Each step's time, read once per log window: host wall time on CPU; on CUDA timing events, synced once
    in ``collect``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.t0: Any = 0.0
        self._pending: list[Any] = []  # CPU: seconds; CUDA: (start, end) events

    def start(self) -> None:
        if self.cuda:
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self.t0, end))
        else:
            self._pending.append(time.perf_counter() - self.t0)

    def collect(self) -> list[float]:
        """Seconds of every step stopped since the last ``collect``."""
        pending, self._pending = self._pending, []
        if not self.cuda:
            return pending
        if pending:
            pending[-1][1].synchronize()  # the events record in order: the last done means all done
        return [start.elapsed_time(end) / 1e3 for start, end in pending]
