"""Train a Llama with PaRO data parallelism: the torchtitan-style trainer of paro-fsdp.

    torchrun --standalone --nproc-per-node 4 train.py --job.config_file train_configs/debug_paro.toml
    torchrun ... train.py --job.config_file FILE.toml --training.steps 50 --parallelism.paro_strategy NIG
    python train.py --job.config_file FILE.toml --print-config      # the merged config, as TOML
    python train.py --job.config_file train_configs/llama7b_paro.toml --estimate --world 32
    python train.py --job.config_file FILE.toml --check-config --world 4   # validate for 4 ranks, exit 0 or 2
    python train.py --help                                         # every key

Exit status: 0 when training finished, and when a SIGTERM or SIGINT (a scheduler's pre-emption, Ctrl-C; torchrun
forwards both) stopped it: every rank finishes its step, all agree on the same step, that step is saved and rank 0
prints the command that resumes. 2: a configuration error, one line on stderr. 1: anything else (a rank or
collective failed, a checkpoint problem, a bug's traceback). ``faults.exit_status`` says how each is reported, under
torchrun too. ``--job.fresh`` (what `make train` passes unless RESUME=1) deletes the previous run's outputs in
job.dump_folder only once the config is valid.

The same code runs on CPU + gloo and on CUDA + NCCL: the device follows ``[comm] backend`` (auto: NCCL when GPUs
are visible). It reads top to bottom, as torchtitan's trainer: config -> distributed -> tokenizer and data -> model
-> PaRO sharding -> optimizer and lr schedule -> checkpoint (resume) -> metrics -> the training loop; each part's
builder is in ``paro_fsdp/train/``.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from paro_fsdp import init_paro_mesh
from paro_fsdp.collective_order import CollectiveOrderCheck
from paro_fsdp.train.checkpoint import TrainState, build_checkpointer, load_model_weights, start_afresh
from paro_fsdp.train.config import JobConfig, grad_accum_steps, group_size
from paro_fsdp.train.config_parse import (check_extras, check_one_process, config_errors, help_text, parse_args,
                                          validate)
from paro_fsdp.train.data import build_dataloader
from paro_fsdp.train.estimate import run_estimate
from paro_fsdp.train.faults import (NonFiniteGuard, TrainingStopped, exit_status, nonfinite_masters,
                                    reduce_with_votes, run_as_script, set_collective_timeout, stopped_line)
from paro_fsdp.train.lr import build_lr_scheduler
from paro_fsdp.train.metrics import (NO_PROFILER, CommMeter, StepTimer, build_metrics, build_profiler, startup_lines,
                                     timeline_writer, where_to_look)
from paro_fsdp.train.optimizer import build_optimizer, clip_grad_norm_
from paro_fsdp.train.parallelize import (auto_strategy, build_loss_fn, build_model, check_policy,
                                         init_distributed, model_args, parallelize)
from paro_fsdp.train.timeline import group_dims
from paro_fsdp.train.tokenizer import tokenizer_of


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[paro] {msg}", flush=True)


class Trainer:
    """One training job. ``Trainer(cfg).train()`` runs it; the attributes (model, optimizer,
    data loader, checkpointer) stay available afterwards, which the tests use."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg, t = cfg, cfg.training

        # ---- distributed: process group, device, mesh ------------------------------------------------------
        self.owns_process_group = not dist.is_initialized()
        self.device = init_distributed(cfg)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        validate(cfg, self.world_size)  # the real world size, whatever the environment said
        self.group_size, self.grad_accum = group_size(cfg, self.world_size), grad_accum_steps(cfg, self.world_size)
        self.mesh = init_paro_mesh(self.group_size)

        # ---- tokenizer and data ----------------------------------------------------------------------------
        self.tokenizer = tokenizer_of(cfg)
        with config_errors(FileNotFoundError, ValueError):  # an empty folder, no documents, bad JSONL
            self.data = build_dataloader(t.dataset, t.dataset_path, self.tokenizer, t.seq_len, t.local_batch_size,
                                         dp_rank=self.rank, dp_world=self.world_size, grad_accum=self.grad_accum,
                                         seed=t.seed)
        self.tokens_per_step = t.local_batch_size * self.world_size * self.grad_accum * t.seq_len

        # ---- model, sharded with PaRO ------------------------------------------------------------------------
        with config_errors(ValueError):  # a Hugging Face folder's problems (HFModelError) are ValueErrors
            self.model_args = model_args(cfg, self.tokenizer.vocab_size)
            if cfg.parallelism.paro_strategy.strip().lower() == "auto":
                cfg.parallelism.paro_strategy = auto_strategy(cfg, self.model_args, self.mesh, self.grad_accum,
                                                              self.device, _log)
            check_policy(cfg, self.model_args)
            self.model = parallelize(build_model(cfg, self.model_args, self.device), cfg, self.mesh, self.device)
        self.forward_loss = build_loss_fn(cfg)
        self.compiled = None  # the graph passes' record: each compiled graph's collective schedule
        if cfg.compile.enable:  # passes, blocks (or the whole model) and, with push_graph, the push: one call
            import passes  # inductor's modules, loaded only to compile

            self.compiled = passes.compile_for(self.model, cfg.compile, cfg.job.dump_folder)

        # ---- optimizer over the parameters (the fp32 masters at their OS level), lr schedule ----------------
        # FSDP2's contract: after the optimizer's step() the engine refreshes its working copies by itself
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)

        # ---- the last configuration checks, then (job.fresh) the previous run's outputs go ----------------
        self.timeline_on = check_extras(cfg)
        self.fresh_removed = start_afresh(cfg, self.rank) if cfg.job.fresh else []
        self.stop_request: Any = None  # main()'s GracefulStop: SIGTERM / SIGINT stop at an agreed step

        # ---- checkpoint: resume from the latest complete one ----------------------------------------------
        self.state = TrainState(self.device)
        self.checkpointer = build_checkpointer(cfg, self.model, self.optimizer, self.lr_scheduler, self.data,
                                               self.state)
        with config_errors(FileNotFoundError):  # checkpoint.load_step names a step that is not there
            self.resumed_from = self.checkpointer.load(cfg.checkpoint.load_step)
        self.initial_load = None  # model weights only, when there is nothing to resume
        if self.resumed_from is None and cfg.checkpoint.initial_load_path:
            self.initial_load = load_model_weights(self.model, cfg.checkpoint.initial_load_path,
                                                   cfg.checkpoint.verify, warn=_log)

        # ---- metrics ------------------------------------------------------------------------------------------
        with config_errors(ValueError):  # $PARO_PEAK_TFLOPS
            self.metrics = build_metrics(cfg, self.rank, self.device, self.model, self.model_args,
                                         self.tokens_per_step, self.world_size, shared_run=self.timeline_on)
        self.comm = CommMeter(self.model.comm_stats())
        self.guard = NonFiniteGuard(t.on_nonfinite, t.max_consecutive_skips)
        self.losses: dict[int, float] = {}  # filled at log steps (the values are read once per log window)
        for line in startup_lines(self):
            _log(line)

    # ---- the training loop ---------------------------------------------------------------------------------
    def train_step(self, profiler: Any = NO_PROFILER) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: ``grad_accum`` micro-steps, clip, step. Returns (loss averaged
        over ranks and micro-steps, global grad norm before clipping) as 0-dim tensors on the
        device. A non-finite loss or norm skips the step or stops the run
        (``training.on_nonfinite``); checking it is the step's one device-to-host read.
        ``profiler`` (``build_profiler``'s) pauses its trace over a traced step's middle micro-steps."""
        total = torch.zeros((), device=self.device)
        for micro in range(self.grad_accum):
            # only the last backward reduces to the OS level (into the parameters' .grad): eager, under
            # the blocks still computing (overlap.py); compiled, in its graphs. The others keep the
            # gradients at the G level: no inter-group traffic per micro-step
            self.model.set_requires_gradient_sync(micro == self.grad_accum - 1)
            profiler.micro_step(micro, self.grad_accum)  # a traced step: its first and last micro-steps only
            batch = next(self.data)
            if self.device.type == "cuda":  # a copy from pageable memory may block the host
                batch = batch.pin_memory()
            loss = self.forward_loss(self.model, batch.to(self.device, non_blocking=True)) / self.grad_accum
            loss.backward()
            total += loss.detach().float()
        max_norm = self.cfg.training.max_norm if self.cfg.training.max_norm > 0 else float("inf")
        grad_norm = self.clip_grad_norm_(max_norm).detach()
        loss_sum, stop_votes = reduce_with_votes(total, self.stop_request)  # with this rank's SIGTERM / SIGINT vote
        loss = loss_sum / self.world_size
        if self.guard.allows_step(self.state.step, loss, grad_norm, self.model, stop_votes):  # global: all agree
            self.optimizer.step()
        else:
            _log(self.guard.last)
        self.optimizer.zero_grad()
        return loss, grad_norm

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` over the trainable parameters' ``.grad`` (the global norm
        before clipping, a 0-dim tensor on the device; ``inf``: measured, not clipped)."""
        return clip_grad_norm_(self.model, max_norm)

    def _read_window(self, pending: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Losses and grad norms of the steps since the last read, copied to the host in one
        transfer (one sync on CUDA) into ``self.losses``; returns the last step's pair."""
        values = torch.stack([v.float() for _, loss, norm in pending for v in (loss, norm)]).tolist()
        for i, (step, _, _) in enumerate(pending):
            self.losses[step] = values[2 * i]
        pending.clear()
        return values[-2], values[-1]

    def train(self) -> dict[int, float]:
        """Train until ``training.steps``; return the loss of every step run here.

        Between log steps nothing waits for the device: loss and grad norm stay device tensors
        and the step timer records CUDA events; at each log step (and the last) the window's
        values are read at once, the line is written, and ``self.losses`` gains the window."""
        cfg, steps = self.cfg, self.cfg.training.steps
        if self.state.step >= steps:
            _log(f"checkpoint step {self.state.step} already reaches training.steps = {steps}: nothing to train "
                 f"(raise --training.steps, or remove {os.path.abspath(self.checkpointer.folder)} to start over)")
            return self.losses
        timer, pending = StepTimer(self.device), []
        self.metrics.begin_window()
        timeline = None
        if self.timeline_on:
            timeline = timeline_writer(cfg, self.model, self.rank, self.device, self.metrics.run_name)
        t_start = time.perf_counter()
        stopped_by, saved, save_s = None, None, 0.0  # a SIGTERM / SIGINT every rank agreed to stop at
        with build_profiler(cfg, self.rank, self.device, self.state.step, on_trace=timeline) as profiler:
            while self.state.step < steps and stopped_by is None:
                self.state.step += 1
                step = self.state.step
                timer.start()
                t_host = time.perf_counter()
                lr = self.optimizer.param_groups[0]["lr"]
                with self._order_check(step) as check:
                    loss, grad_norm = self.train_step(profiler)
                if check is not None:
                    _log(f"collective order: {check.summary()}")
                self.lr_scheduler.step()
                timer.stop()
                pending.append((step, loss, grad_norm))
                comm = self.comm.delta()  # host-side ledger: the last step's bytes
                if self.stop_request is not None:  # the votes read with the guard's check: the same on every rank
                    stopped_by = self.stop_request.agreed(self.guard.stop_votes, self.world_size,
                                                          time.perf_counter() - t_host)
                if self.metrics.should_log(step) or stopped_by:
                    step_times = timer.collect()  # waits for the step's last kernel: the window's one sync
                    loss_value, norm_value = self._read_window(pending)
                    self.metrics.log(step, loss_value, norm_value, lr, step_times, comm,
                                     self.model.memory_report(self.optimizer))
                if step == (self.resumed_from or 0) + 1:  # the (usually shorter) training timeout, as torchtitan
                    set_collective_timeout(datetime.timedelta(seconds=cfg.comm.train_timeout_seconds))
                    self._log_compiled_schedule(step)
                profiler.step()  # before the save: a traced step's timeline never shows a checkpoint's collectives
                if self.checkpointer.should_save(step, steps) or (stopped_by and self.checkpointer.enabled):
                    saved, save_s = self._save(step, quiet=stopped_by is not None)
        if timeline is not None:  # a stop: a drawing under way must not hold up the exit torchrun is timing
            timeline.close(wait=stopped_by is None)
        if pending:  # normally empty: the last step always logs
            self._read_window(pending)
        if stopped_by is not None:
            if self.rank == 0 and self.stop_request.said():  # False: the watcher is writing its own last line
                _log(stopped_line(stopped_by, self.state.step, steps, saved, save_s))
            return self.losses
        first, last = self.losses[min(self.losses)], self.losses[max(self.losses)]
        _log(f"trained steps {min(self.losses)}..{steps} in {time.perf_counter() - t_start:.1f} s: loss {first:.4f} "
             f"-> {last:.4f}")
        for line in where_to_look(cfg, self.metrics.tb_dir, self.timeline_on) if self.rank == 0 else []:
            _log(line)
        if cfg.checkpoint.last_save_in_hf:
            from paro_fsdp.train.hf_model import export

            path, how = export(self.model, cfg, self.model_args, steps)
            _log(f"Hugging Face export (checkpoint.last_save_in_hf): {os.path.abspath(path)}   load it with {how}")
        return self.losses

    def _save(self, step: int, quiet: bool) -> tuple[str, float]:
        """Save ``step`` unless a master is non-finite (never reachable by a skipped step; an overflow in the
        update itself). Returns (path, seconds); ``quiet``: a stop's own line names it."""
        bad = nonfinite_masters(self.model)
        if bad:
            raise TrainingStopped(f"step {step}: the fp32 master of {bad} is non-finite, so step-{step} is not "
                                  f"saved; {self.checkpointer.latest_hint()}; lower optimizer.lr")
        t_save = time.perf_counter()
        path = self.checkpointer.save(step)
        save_s = time.perf_counter() - t_save
        if not quiet:
            _log(f"saved checkpoint {path} ({save_s:.2f} s)")
        return path, save_s

    def _order_check(self, step: int) -> Any:
        """With ``comm.check_collective_order``: every collective of this run's first step (with
        compile, the second: the first compiles) compared across ranks before it is issued."""
        first = (self.resumed_from or 0) + (2 if self.cfg.compile.enable else 1)
        if not self.cfg.comm.check_collective_order or step != min(first, self.cfg.training.steps):
            return contextlib.nullcontext()
        return CollectiveOrderCheck(group_dims(self.model.paro_mesh_groups(), dist.group.WORLD.group_name),
                                    f"step {step}")

    def _log_compiled_schedule(self, step: int) -> None:
        """After the first (compiling) step: what the graph passes did, on rank 0's console
        summary and as a TensorBoard text entry."""
        if self.compiled is None or self.rank != 0 or not self.compiled.records:
            return
        import passes

        for r in self.compiled.records[:2]:
            _log(f"compiled {r.phase} graph: {passes.summary(r.before)} -> {passes.summary(r.after)} {r.changes}")
        dump = self.cfg.compile.dump_schedule
        _log(f"compiled {len(self.compiled.records)} graphs with collectives; passes {self.compiled.names}"
             + (f"; schedules in {os.path.join(self.cfg.job.dump_folder, 'compile')}" if dump else ""))
        if self.metrics.writer is not None and dump:
            self.metrics.writer.add_text("compile/schedule", "```\n" + self.compiled.report() + "\n```", step)

    def close(self, failed: bool = False) -> None:
        """Flush the metrics; leave the process group (after a barrier, unless the run failed:
        a peer may be gone, and a barrier would wait for it)."""
        self.metrics.close()
        if self.owns_process_group and dist.is_initialized() and not failed:
            if hasattr(getattr(self, "model", None), "wait_for_params"):
                self.model.wait_for_params()  # the last step's pushes, before the process group goes
            dist.barrier()
            dist.destroy_process_group()


def main(argv: Optional[list[str]] = None, as_script: bool = False) -> int:
    """The command line; returns the exit status (module docstring). ``as_script`` (``python train.py``,
    torchrun's workers): SIGTERM and SIGINT stop the run at a step every rank agrees on, saved, and errors are
    reported as ``faults.exit_status`` says."""
    argv = sys.argv[1:] if argv is None else argv
    return exit_status(lambda run: _run(argv, run), as_script)


def _run(argv: list[str], run: Any) -> int:
    cfg, cli = parse_args(argv)
    is_rank0 = os.environ.get("RANK", "0") == "0"
    if cli.help:
        print(help_text())
        return 0
    if cli.print_config or cli.check_config:  # --check-config: parse_args validated for --world N (or $WORLD_SIZE)
        if cli.print_config and is_rank0:
            print(cfg.to_toml(), end="")
        return 0
    if cli.estimate:
        return run_estimate(cfg, cli.world) if is_rank0 else 0
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        check_one_process(cfg, argv)
    run.trainer = Trainer(cfg)
    run.trainer.stop_request = run.stop
    run.trainer.train()
    return 0


if __name__ == "__main__":
    run_as_script(lambda: main(as_script=True))
