"""Train a Llama with PaRO data parallelism: the torchtitan-style trainer of paro-fsdp.

    torchrun --standalone --nproc-per-node 4 train.py --job.config_file train_configs/debug_paro.toml
    torchrun ... train.py --job.config_file FILE.toml --training.steps 50 --parallelism.paro_strategy NIG
    python train.py --job.config_file FILE.toml --print-config      # the merged config, as TOML
    python train.py --job.config_file train_configs/llama7b_paro.toml --estimate --world 32
    python train.py --job.config_file FILE.toml --check-config --world 4   # validate for 4 ranks, exit 0 or 2
    python train.py --help                                         # every key

Exit status: 0 when training finished, and when a SIGTERM or SIGINT (a scheduler's pre-emption,
Ctrl-C; torchrun forwards both) stopped it: every rank finishes its step, all agree on the same
step (the vote rides in the step's loss all-reduce), that step is saved and rank 0 prints one
line with the command that resumes. 2: a configuration error, one line on stderr (under torchrun
rank 0's, printed before torchrun's ChildFailedError summary, which then lists that one rank).
1: anything else (a rank or collective failed, a checkpoint problem, a bug's traceback).
torchrun's own exit status is 1 whenever a worker failed or torchrun itself was signalled; a
bad config under `make train` is caught before torchrun starts (make reports status 2).
``--job.fresh`` (what `make train` passes unless RESUME=1) deletes the previous run's outputs in
job.dump_folder only once the config is valid.

The same code runs on CPU + gloo and on CUDA + NCCL: the device follows ``[comm] backend``
(auto: NCCL when GPUs are visible). Read top to bottom, as torchtitan's trainer: config ->
distributed -> tokenizer and data -> model -> PaRO sharding -> optimizer and lr schedule ->
checkpoint (resume) -> metrics -> the training loop.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.util
import io
import os
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from paro_fsdp import init_paro_mesh
from paro_fsdp.collective_order import CollectiveOrderCheck, CollectiveOrderError
from paro_fsdp.mesh import device_type_for_backend, local_cuda_index
from paro_fsdp.train.checkpoint import (CheckpointError, CheckpointManager, ModelState, OptimizerState, SchedulerState, TrainState,
                                        load_model_weights)
from paro_fsdp.train.config import ConfigError, JobConfig, grad_accum_steps, group_size, tokenizer_spec
from paro_fsdp.train.config_parse import help_text, parse_args, validate
from paro_fsdp.train.data import build_dataloader, describe
from paro_fsdp.train.faults import (GracefulStop, NonFiniteGuard, TrainingStopped, collective_failure, config_error_exit,
                                    nonfinite_masters, restart_store, resume_command, set_collective_timeout, stuck_line)
from paro_fsdp.train.lr import build_lr_scheduler
from paro_fsdp.train.metrics import NO_PROFILER, CommMeter, MetricsLogger, StepTimer, build_profiler, flops_per_token
from paro_fsdp.train.optimizer import build_optimizer, clip_grad_norm_
from paro_fsdp.train.parallelize import DTYPES, apply_compile, build_model, check_policy, model_args, parallelize
from paro_fsdp.train.timeline import TimelineWriter, gloo_threads, group_dims
from paro_fsdp.train.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parent


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[paro] {msg}", flush=True)


class _LoggedOrderCheck(CollectiveOrderCheck):
    """comm.check_collective_order's check of one step, which logs what it compared."""

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        if exc[0] is None:
            _log(f"collective order: {self.summary()}")
        return result


class Trainer:
    """One training job. ``Trainer(cfg).train()`` runs it; the attributes (model, optimizer,
    data loader, checkpointer) stay available afterwards, which the tests use."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        t = cfg.training

        # ---- distributed: process group, device, mesh ---------------------------------------
        self.owns_process_group = not dist.is_initialized()
        self.device = self._init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        validate(cfg, self.world_size)  # the real world size, whatever the environment said
        self.group_size = group_size(cfg, self.world_size)
        self.grad_accum = grad_accum_steps(cfg, self.world_size)
        self.mesh = init_paro_mesh(self.group_size)
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

        # ---- tokenizer and data --------------------------------------------------------------
        if cfg.model.name == "hf":  # the folder first: without a model its tokenizer does not matter
            _check_hf_folder(cfg)
        try:
            self.tokenizer = build_tokenizer(tokenizer_spec(cfg))
        except (FileNotFoundError, RuntimeError) as exc:
            if cfg.model.name == "hf" and cfg.model.tokenizer == "auto" and isinstance(exc, FileNotFoundError):
                raise ConfigError(f"model.hf_path = {cfg.model.hf_path!r} has no tokenizer.json (model.tokenizer = "
                                  f"\"auto\" reads the folder's); valid: --model.tokenizer PATH (a tokenizer.json, or the "
                                  f"folder holding one)") from None
            raise ConfigError(str(exc)) from None
        try:
            self.data = build_dataloader(t.dataset, t.dataset_path, self.tokenizer, t.seq_len, t.local_batch_size,
                                         dp_rank=self.rank, dp_world=self.world_size, grad_accum=self.grad_accum, seed=t.seed)
        except (FileNotFoundError, ValueError) as exc:  # an empty folder, no documents, bad JSONL: one line
            raise ConfigError(str(exc)) from None
        global_batch = t.local_batch_size * self.world_size * self.grad_accum
        self.tokens_per_step = global_batch * t.seq_len

        # ---- model, sharded with PaRO --------------------------------------------------------
        try:  # a Hugging Face folder's problems (hf_model.HFModelError) are ValueErrors: one line each
            self.model_args = model_args(cfg, self.tokenizer.vocab_size)
            if cfg.parallelism.paro_strategy.strip().lower() == "auto":
                self._choose_strategy()
            problem = check_policy(cfg, self.model_args)
            if problem:
                raise ConfigError(problem)
            model = build_model(cfg, self.model_args, self.device)
            self.model = parallelize(model, cfg, self.mesh, self.device)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.forward_loss = _hf_loss() if cfg.model.name == "hf" else (lambda model, batch: model(batch).loss)
        self.compiled = None  # the graph passes' record: each compiled graph's collective schedule
        if cfg.compile.enable:
            import passes  # inductor's modules, loaded only to compile

            self.compiled = passes.install_for(self.model, cfg.compile, cfg.job.dump_folder)
            apply_compile(self.model, cfg)

        # ---- optimizer over the parameters (the fp32 masters at their OS level), lr schedule -----
        # FSDP2's contract: torch's optimizer over model.parameters(); after its step() the engine
        # refreshes its P-level working copies by itself (torch's optimizer step hook)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        if cfg.compile.enable and cfg.compile.push_graph:  # that refresh of the working copies as a graph
            from paro_fsdp.traced import compile_push

            compile_push(self.model, backend=cfg.compile.backend)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)

        # ---- the last configuration checks, then (job.fresh) the previous run's outputs go ------
        if cfg.metrics.enable_tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("metrics.enable_tensorboard = true needs the tensorboard package (pip install tensorboard, "
                              "or this project's [train] extra); valid: false, or install it")
        self.timeline_on = cfg.metrics.enable_tensorboard and cfg.profiling.enable_profiling and cfg.profiling.timeline
        if self.timeline_on and importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("profiling.timeline = true (with metrics.enable_tensorboard and profiling.enable_profiling) "
                              "draws with matplotlib (pip install matplotlib, or this project's [train] extra); valid: "
                              "false, or install it")
        self.fresh_removed = self._start_afresh() if cfg.job.fresh else []
        self.stop_request: Optional[GracefulStop] = None  # set by main(): SIGTERM / SIGINT stop at an agreed step

        # ---- checkpoint: resume from the latest complete one -----------------------------------
        self.state = TrainState(self.device)
        c = cfg.checkpoint
        self.checkpointer = CheckpointManager(
            os.path.join(cfg.job.dump_folder, c.folder), c.interval, c.keep_latest_k, c.enable,
            states={"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer),
                    "lr_scheduler": SchedulerState(self.lr_scheduler),
                    "dataloader": self.data, "train_state": self.state},
            verify=c.verify,
        )
        try:
            self.resumed_from = self.checkpointer.load(c.load_step)
        except FileNotFoundError as exc:  # checkpoint.load_step names a step that is not there
            raise ConfigError(str(exc)) from None
        self.initial_load = None  # model weights only, when there is nothing to resume
        if self.resumed_from is None and c.initial_load_path:
            self.initial_load = load_model_weights(self.model, c.initial_load_path, c.verify, warn=_log)

        # ---- metrics, profiler ---------------------------------------------------------------
        run_name = time.strftime("%Y%m%d-%H%M%S")
        if self.timeline_on:  # every rank writes its timeline next to rank 0's run
            names = [run_name]
            dist.broadcast_object_list(names, src=0)
            run_name = names[0]
        self.run_name = run_name
        a = self.model_args
        try:
            self.metrics = MetricsLogger(
                cfg, self.rank, self.device, t.steps, self.tokens_per_step, self.world_size, run_name,
                flops_per_token=flops_per_token(sum(p.numel() for p in self.model.parameters()), a.n_layers, a.dim,
                                                t.seq_len, a.vocab_size * a.dim),
                param_dtype=DTYPES[t.mixed_precision_param])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.comm = CommMeter(self.model.comm_stats())
        self.guard = NonFiniteGuard(t.on_nonfinite, t.max_consecutive_skips)
        self.losses: dict[int, float] = {}  # filled at log steps (the values are read once per log window)
        self._print_header(global_batch)

    def _start_afresh(self) -> list[str]:
        """``job.fresh``: rank 0 deletes what a previous run of this trainer wrote in the dump
        folder (checkpoint, TensorBoard and trace folders, compile schedules, metrics.jsonl), and
        nothing else; every config check has passed by now, nothing of this run is written yet.
        A folder that would be the dump folder itself, or hold it, is never deleted (a
        ``checkpoint.folder = "."`` must not wipe a home directory). Returns what it removed."""
        cfg, removed = self.cfg, []
        if self.rank == 0:
            dump = os.path.realpath(cfg.job.dump_folder)
            for name in (cfg.checkpoint.folder, cfg.metrics.save_tb_folder, cfg.profiling.save_traces_folder, "compile",
                         "metrics.jsonl"):
                path = os.path.realpath(os.path.join(dump, name))
                if not os.path.lexists(path) or os.path.commonpath([path, dump]) == path or path == os.path.realpath(os.getcwd()):
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
                removed.append(path)
        dist.barrier()
        return removed

    def _choose_strategy(self) -> None:
        """``paro_strategy = "auto"``: the advisor (paro_fsdp/cost/) ranks all 27 strategies
        on the given cluster file, or on this mesh calibrated now; log the table, train with the
        fastest that fits. Rank 0's choice is broadcast so every rank shards the same way."""
        from paro_fsdp.cost.calibrate import calibrate_in_process
        from paro_fsdp.cost.cluster import AdvisorError, load_cluster
        from paro_fsdp.cost.predict import choose_strategy

        t, p = self.cfg.training, self.cfg.parallelism
        dtype = {"bfloat16": "bf16", "float32": "fp32"}
        try:
            if p.paro_cluster_file:
                cluster, source = load_cluster(p.paro_cluster_file), p.paro_cluster_file
            else:
                cluster = calibrate_in_process(self.mesh, self.model_args, t.local_batch_size, t.seq_len,
                                               dtype[t.mixed_precision_param])
                source = "calibrated at start-up"
            strategy, table = choose_strategy(
                self.model_args, self.world_size, self.group_size, t.local_batch_size, self.grad_accum, t.seq_len,
                dtype[t.mixed_precision_param], cluster, reduce_dtype=dtype[t.mixed_precision_reduce],
                trainable_fraction=self._trainable_fraction(), activation_checkpoint=self.cfg.activation_checkpoint.mode,
                reshard_after_forward=p.paro_reshard_after_forward)
        except AdvisorError as exc:
            raise ConfigError(f"parallelism.paro_strategy = \"auto\": {exc}") from None
        choice = [strategy.name]
        dist.broadcast_object_list(choice, src=0)
        p.paro_strategy = choice[0]
        _log(f"paro_strategy = auto ({source}):\n{table}")
        _log(f"paro_strategy = auto: training with {choice[0]}")

    def _trainable_fraction(self) -> float:
        """Trainable share of the weights (LoRA: the adapters'), from the model on the meta device."""
        if not self.cfg.peft.lora_rank:
            return 1.0
        from paro_fsdp.integrations.hf import count_trainable

        trainable, total = count_trainable(build_model(self.cfg, self.model_args, self.device))
        return trainable / total

    def _init_distributed(self) -> torch.device:
        backend = self.cfg.comm.backend
        if dist.is_initialized():
            backend = dist.get_backend()
        else:
            if backend == "auto":
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if device_type_for_backend(backend) == "cuda" and not torch.cuda.is_available():
                raise ConfigError(f"comm.backend = \"{backend}\" needs CUDA GPUs and none is visible; valid: auto, gloo")
            if "RANK" not in os.environ:  # plain `python train.py`: a world of one
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            timeout = datetime.timedelta(seconds=self.cfg.comm.init_timeout_seconds)
            kwargs: dict[str, Any] = {"timeout": timeout}
            store = restart_store(timeout)  # under torchrun: a fresh key space per restart attempt
            if store is not None:
                kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
            if device_type_for_backend(backend) == "cuda":  # one GPU per process, named so NCCL need not guess
                device = torch.device("cuda", local_cuda_index())
                torch.cuda.set_device(device)
                kwargs["device_id"] = device
            dist.init_process_group(backend, **kwargs)
        if device_type_for_backend(backend) == "cuda":
            torch.cuda.set_device(local_cuda_index())
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _print_header(self, global_batch: int) -> None:
        cfg, a = self.cfg, self.model_args
        n_params = sum(p.numel() for p in self.model.parameters())
        strategies = sorted({str(s) for s in self.model.paro_strategies().values()})
        _log(f"{cfg.job.description} | world {self.world_size} = {self.world_size // self.group_size} groups x "
             f"{self.group_size} | strategy {', '.join(strategies)} | {dist.get_backend()} on {self.device.type}")
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        what = (f"hf {cfg.model.hf_path} ({_hf_architecture(self.model)})" if cfg.model.name == "hf"
                else f"{cfg.model.name}/{cfg.model.flavor}")
        lora = (f", LoRA rank {cfg.peft.lora_rank} on {cfg.peft.target_modules or 'peft default targets'}"
                if cfg.peft.lora_rank else "")
        _log(f"model {what}: {n_params / 1e6:,.2f}M params, {trainable:,} of them trained "
             f"({100 * trainable / n_params:.2f}%{lora}), vocab {a.vocab_size}, "
             f"seq {cfg.training.seq_len} | params {cfg.training.mixed_precision_param}, grads "
             f"{cfg.training.mixed_precision_reduce} (accumulated in {cfg.training.mixed_precision_accumulate}), master fp32 "
             f"| activation checkpoint {cfg.activation_checkpoint.mode}")
        _log(f"batch {cfg.training.local_batch_size} per rank x {self.world_size} ranks x {self.grad_accum} accumulation = "
             f"{global_batch} sequences = {self.tokens_per_step:,} tokens per step")
        _log(f"data: {describe(self.data, cfg.training.dataset, cfg.training.dataset_path)}")
        if self.fresh_removed:
            _log(f"job.fresh: removed the previous run's {', '.join(self.fresh_removed)}")
        for name in self.checkpointer.removed:
            _log(f"removed {self.checkpointer.folder}/{name}: a save or prune that did not finish (the run stopped "
                 f"while writing it)")
        for line in self.checkpointer.notes:  # damaged folders moved aside, later steps a resume replaces
            _log(line)
        if self.resumed_from is not None:
            _log(f"resumed from {self.checkpointer.folder}/step-{self.resumed_from}")
        elif self.initial_load:
            _log(f"started from {self.initial_load} in {cfg.checkpoint.initial_load_path} (optimizer, lr schedule and "
                 f"data from step 0)")
        elif cfg.checkpoint.enable:
            _log(f"no checkpoint in {self.checkpointer.folder}: starting from step 0")

    # ---- the training loop --------------------------------------------------------------------
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
            batch = batch.to(self.device, non_blocking=True)
            loss = self.forward_loss(self.model, batch) / self.grad_accum
            loss.backward()
            total += loss.detach().float()
        max_norm = self.cfg.training.max_norm if self.cfg.training.max_norm > 0 else float("inf")
        grad_norm = self.clip_grad_norm_(max_norm).detach()
        # the loss sum and this rank's stop vote (SIGTERM / SIGINT noted) in one all-reduce: every
        # rank reads the same vote count at the same step (a host scalar: no copy, no sync)
        packed = torch.zeros(3, device=self.device)  # loss sum, ranks that got SIGTERM, ranks that got SIGINT
        packed[0] = total
        if self.stop_request is not None and self.stop_request.requested:
            term, interrupt = self.stop_request.votes()  # host scalars: kernel arguments, no copy, no sync
            packed[1] += term
            packed[2] += interrupt
        dist.all_reduce(packed)
        loss = packed[0] / self.world_size
        stop_votes = packed[1:] if self.stop_request is not None else None
        if self.guard.allows_step(self.state.step, loss, grad_norm, self.model, stop_votes):  # global: all ranks agree
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
        timer = StepTimer(self.device)
        pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.metrics.begin_window()
        timeline = self._timeline_writer()
        t_start = time.perf_counter()
        stopped_by, saved, save_s = None, None, 0.0  # a SIGTERM / SIGINT every rank agreed to stop at
        with build_profiler(cfg, self.rank, self.device, self.state.step, on_trace=timeline) as profiler:
            while self.state.step < steps:
                self.state.step += 1
                step = self.state.step
                timer.start()
                t_host = time.perf_counter()
                lr = self.optimizer.param_groups[0]["lr"]
                with self._order_check(step):
                    loss, grad_norm = self.train_step(profiler)
                self.lr_scheduler.step()
                timer.stop()
                pending.append((step, loss, grad_norm))
                comm = self.comm.delta()  # host-side ledger: the last step's bytes
                stop = self.stop_request is not None and sum(self.guard.stop_votes) > 0  # the same on every rank
                if stop:
                    self.stop_request.stopping = True  # the agreed step: only the save is left
                    term, interrupt = self.guard.stop_votes
                    stopped_by = (f"SIGTERM ({term} of {self.world_size} ranks got it)" if term >= interrupt else
                                  f"SIGINT ({interrupt} of {self.world_size} ranks got it)")
                elif self.stop_request is not None:
                    self.stop_request.step_took(time.perf_counter() - t_host)
                if self.metrics.should_log(step) or stop:
                    step_times = timer.collect()  # waits for the step's last kernel: the window's one sync
                    loss_value, norm_value = self._read_window(pending)
                    self.metrics.log(step, loss_value, norm_value, lr, step_times, comm,
                                     self.model.memory_report(self.optimizer))
                if step == (self.resumed_from or 0) + 1:
                    self._set_train_timeout()
                    self._log_compiled_schedule(step)
                profiler.step()  # before the save: a traced step's timeline never shows a checkpoint's collectives
                if self.checkpointer.should_save(step, steps) or (stop and self.checkpointer.enabled):
                    bad = nonfinite_masters(self.model)
                    if bad:  # never reachable by a skipped step; an overflow in the update itself
                        raise TrainingStopped(f"step {step}: the fp32 master of {bad} is non-finite, so step-{step} is not "
                                              f"saved; {self.checkpointer.latest_hint()}; lower optimizer.lr")
                    t_save = time.perf_counter()
                    path = saved = self.checkpointer.save(step)
                    save_s = time.perf_counter() - t_save
                    if not stop:  # a stop's own line names it
                        _log(f"saved checkpoint {path} ({save_s:.2f} s)")
                if stop:
                    break
        if stopped_by is not None:
            return self._stopped(stopped_by, saved, save_s if saved else 0.0, timeline, pending)
        if timeline is not None:
            timeline.close()
        if pending:  # normally empty: the last step always logs
            self._read_window(pending)
        elapsed = time.perf_counter() - t_start
        first, last = self.losses[min(self.losses)], self.losses[max(self.losses)]
        _log(f"trained steps {min(self.losses)}..{steps} in {elapsed:.1f} s: loss {first:.4f} -> {last:.4f}")
        self._print_where_to_look()
        if cfg.checkpoint.last_save_in_hf:
            from paro_fsdp.train.hf_model import export

            path, how = export(self.model, cfg, self.model_args, steps)
            _log(f"Hugging Face export (checkpoint.last_save_in_hf): {os.path.abspath(path)}   load it with {how}")
        return self.losses

    def _stopped(self, signal_name: str, saved: Optional[str], save_s: float, timeline: Optional[TimelineWriter],
                 pending: list) -> dict[int, float]:
        """The end of a run every rank agreed to stop (SIGTERM / SIGINT): one line on rank 0 with
        the command that resumes from the step just saved."""
        if timeline is not None:
            timeline.close(wait=False)  # a drawing under way must not hold up the exit torchrun is timing
        if pending:
            self._read_window(pending)
        step = self.state.step
        if self.rank == 0 and self.stop_request.said():  # False: the watcher is writing its own last line
            where = (f"saved {os.path.abspath(saved)} in {save_s:.2f} s" if saved else
                     "checkpoint.enable = false, so nothing was saved and a rerun starts from step 0")
            make = " (or: make train RESUME=1)" if os.environ.get("MAKELEVEL") else ""
            _log(f"stopped by {signal_name} at step {step}/{self.cfg.training.steps}, which every rank finished; {where}; "
                 f"resume with: {resume_command(sys.argv)}{make}")
        return self.losses

    def _order_check(self, step: int) -> Any:
        """With ``comm.check_collective_order``: every collective of this run's first step (with
        compile, the second: the first compiles) compared across ranks before it is issued."""
        first = (self.resumed_from or 0) + (2 if self.cfg.compile.enable else 1)
        if not self.cfg.comm.check_collective_order or step != min(first, self.cfg.training.steps):
            return contextlib.nullcontext()
        dims = group_dims(self.model.paro_mesh_groups(), dist.group.WORLD.group_name)
        return _LoggedOrderCheck(dims, f"step {step}")

    def _timeline_writer(self) -> Optional[TimelineWriter]:
        """With ``profiling.timeline``: the sink that draws each trace into this rank's TensorBoard
        run ``<run>/timeline_rank<r>``. On gloo it first learns which worker threads serve which
        mesh dimension (``timeline.gloo_threads``: collectives, so every rank calls it)."""
        if not self.timeline_on:
            return None
        dims = group_dims(self.model.paro_mesh_groups(), dist.group.WORLD.group_name)
        threads = gloo_threads(dims) if self.device.type == "cpu" else {}
        m = self.cfg.metrics
        log_dir = os.path.join(self.cfg.job.dump_folder, m.save_tb_folder, self.run_name, f"timeline_rank{self.rank}")
        # ProfilerStep#N runs while the profiler's step_num is N: trainer step N + 1 (build_profiler)
        return TimelineWriter(log_dir, self.rank, "compiled" if self.cfg.compile.enable else "eager", threads, dims)

    def _log_compiled_schedule(self, step: int) -> None:
        """After the first (compiling) step: what the graph passes did, on rank 0's console
        summary and as a TensorBoard text entry."""
        if self.compiled is None or self.rank != 0 or not self.compiled.records:
            return
        import passes

        for r in self.compiled.records[:2]:
            _log(f"compiled {r.phase} graph: {passes.summary(r.before)} -> {passes.summary(r.after)} {r.changes}")
        _log(f"compiled {len(self.compiled.records)} graphs with collectives; passes {self.compiled.names}"
             + (f"; schedules in {os.path.join(self.cfg.job.dump_folder, 'compile')}" if self.cfg.compile.dump_schedule else ""))
        if self.metrics.writer is not None and self.cfg.compile.dump_schedule:
            self.metrics.writer.add_text("compile/schedule", "```\n" + self.compiled.report() + "\n```", step)

    def _set_train_timeout(self) -> None:
        """After the first step the (usually shorter) training timeout applies, as in torchtitan."""
        set_collective_timeout(datetime.timedelta(seconds=self.cfg.comm.train_timeout_seconds))

    def _print_where_to_look(self) -> None:
        if self.rank != 0:
            return
        dump = os.path.abspath(self.cfg.job.dump_folder)
        tb_bin = Path(sys.executable).parent / "tensorboard"
        tb = str(tb_bin) if tb_bin.exists() else "tensorboard"
        if self.metrics.tb_dir:
            _log(f"TensorBoard logs: {os.path.abspath(self.metrics.tb_dir)}")
            _log(f"open them with:   {tb} --logdir {dump} --port 6006   then browse http://localhost:6006")
        if self.cfg.profiling.enable_profiling:
            traces = os.path.join(dump, self.cfg.profiling.save_traces_folder)
            _log(f"profiler traces:  {traces} (open a rank*.pt.trace.json in Perfetto or chrome://tracing; "
                 f"TensorBoard's torch-tb-profiler tab lists them but draws its charts only with internet access)")
            if self.timeline_on:
                _log("step timelines:   TensorBoard's Images tab, timeline/rank<r> (runs <run>/timeline_rank<r>), "
                     "and the timeline/overlap_fraction and timeline/inter_busy_fraction scalars")
        _log(f"metrics per logged step: {os.path.join(dump, 'metrics.jsonl')}")

    def close(self, failed: bool = False) -> None:
        """Flush the metrics; leave the process group (after a barrier, unless the run failed:
        a peer may be gone, and a barrier would wait for it)."""
        self.metrics.close()
        if self.owns_process_group and dist.is_initialized():
            if not failed:
                if hasattr(getattr(self, "model", None), "wait_for_params"):
                    self.model.wait_for_params()  # the last step's pushes, before the process group goes
                dist.barrier()
                dist.destroy_process_group()


# ---- --estimate: memory and communication without hardware --------------------------------------
def run_estimate(cfg: JobConfig, world: Optional[int]) -> int:
    """Per-rank model-state memory and per-step communication of ``cfg`` on ``world`` ranks,
    measured by running one optimizer step through the engine on a fake process group
    (tools/estimate.py), next to the spec's formulas, with ZeRO-3 (GGG) for comparison."""
    if not world:
        print("train.py: error: --estimate needs --world N (the number of ranks to estimate for)", file=sys.stderr)
        return 2
    from paro_fsdp.train.estimate import estimate, format_table

    t, p = cfg.training, cfg.parallelism
    m = group_size(cfg, world, local_world_size=min(8, world))
    accum = grad_accum_steps(cfg, world)
    try:
        args = model_args(cfg, build_tokenizer(tokenizer_spec(cfg)).vocab_size)
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    dtype = {"bfloat16": "bf16", "float32": "fp32"}
    chosen = p.paro_strategy.upper()
    if chosen == "AUTO":  # rank the strategies on the cluster file (default: the A100 preset)
        from paro_fsdp.cost.cluster import AdvisorError
        from paro_fsdp.cost.predict import choose_strategy

        try:
            best, table = choose_strategy(args, world, m, t.local_batch_size, accum, t.seq_len,
                                          dtype[t.mixed_precision_param], p.paro_cluster_file or "a100_ib",
                                          reduce_dtype=dtype[t.mixed_precision_reduce],
                                          activation_checkpoint=cfg.activation_checkpoint.mode,
                                          reshard_after_forward=p.paro_reshard_after_forward)
        except AdvisorError as exc:
            print(f"train.py: error: {exc}", file=sys.stderr)
            return 2
        print(table)
        chosen = best.name
    strategies = [chosen] + (["GGG"] if chosen != "GGG" else [])
    wall = time.perf_counter()
    rows = estimate(args, world, m, strategies, grad_accum=accum, dtype=dtype[t.mixed_precision_param],
                    reduce_dtype=dtype[t.mixed_precision_reduce], max_norm=t.max_norm if t.max_norm > 0 else 1.0,
                    accumulate_dtype=dtype[t.mixed_precision_accumulate])
    r0 = rows[0]
    what = f"hf {cfg.model.hf_path} (as a Llama of its shapes)" if cfg.model.name == "hf" else cfg.model.flavor
    print(f"{cfg.job.config_file or 'default config'}: {what}, {r0['psi'] / 1e9:.3f} B parameters, "
          f"{world} ranks = {world // m} groups x {m}, {accum} micro-steps of {t.local_batch_size} x {t.seq_len} tokens "
          f"per rank per step, P {t.mixed_precision_param}, G {t.mixed_precision_reduce} on the wire and "
          f"{t.mixed_precision_accumulate} accumulated, OS fp32 {cfg.optimizer.name}")
    print("per rank: model-state memory (P, G, OS) and bytes sent per optimizer step, measured through the engine "
          "on a fake process group, beside the spec's formulas (activations not included)")
    print(format_table(rows))
    if p.paro_policy:
        print(f"note: the per-tensor paro_policy {p.paro_policy} is not modelled; every tensor uses {p.paro_strategy}")
    print(f"({time.perf_counter() - wall:.1f} s)")
    return 0


def main(argv: Optional[list[str]] = None, as_script: bool = False) -> int:
    """The command line; returns the exit status (module docstring). ``as_script`` (``python
    train.py``, torchrun's workers): SIGTERM and SIGINT stop the run at a step every rank agrees
    on, saved (``faults.GracefulStop``); a rank that cannot get there in time says so in one line
    and exits 1; under torchrun a configuration error is reported as ``faults.config_error_exit``
    does (rank 0's line and status 2; the ranks of its node that agree leave with 0)."""
    argv = sys.argv[1:] if argv is None else argv
    is_rank0 = os.environ.get("RANK", "0") == "0"
    rank = int(os.environ.get("RANK", "0"))
    had_process_group = dist.is_initialized()
    trainer, failed = None, True
    said = lambda: True  # noqa: E731 - under as_script: GracefulStop's (False: a stopped rank's line is being written)
    stop = None
    if as_script:
        stop = GracefulStop(lambda signum: stuck_line(rank, trainer.state.step if trainer is not None else 0, signum,
                                                      time.monotonic() - stop.t_signal), _error_line)
        said = stop.said
    try:
        cfg, cli = parse_args(argv)
        if cli.help:
            print(help_text())
            return 0
        if cli.print_config:
            if is_rank0:
                print(cfg.to_toml(), end="")
            return 0
        if cli.check_config:  # parse_args validated for --world N (or $WORLD_SIZE)
            return 0
        if cli.estimate:
            return run_estimate(cfg, cli.world) if is_rank0 else 0
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            _check_one_process(cfg, argv)
        trainer = Trainer(cfg)
        trainer.stop_request = stop
        trainer.train()
        failed = False
    except ConfigError as exc:
        if trainer is None and dist.is_initialized() and not had_process_group:
            dist.destroy_process_group()
        if as_script:
            return config_error_exit(str(exc), rank, _error_line)
        if is_rank0:
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (TrainingStopped, CheckpointError, CollectiveOrderError) as exc:  # the same decision on every rank: rank 0 says it
        if said() and is_rank0:
            _error_line(str(exc))
        if trainer is None and dist.is_initialized() and not had_process_group:
            dist.destroy_process_group()
        return 1
    except (RuntimeError, dist.DistError, CheckpointException) as exc:
        step = trainer.state.step if trainer is not None else 0
        line = collective_failure(exc, rank, step, _timeout_of(trainer))
        if line is None:
            raise
        if said():
            _error_line(line)  # every rank: the survivors say who saw what
        return 1
    finally:
        if trainer is not None:
            trainer.close(failed=failed)
    return 0


def _check_one_process(cfg: JobConfig, argv: list[str]) -> None:
    """``python train.py`` without torchrun runs as a world of one rank: a config for more
    ranks fails its checks for one; say so, with the torchrun command for the config's world."""
    try:
        validate(cfg, 1, 1)
    except ConfigError as exc:
        n = _suggest_nproc(cfg)
        import shlex

        cmd = shlex.join(["torchrun", "--standalone", "--nproc-per-node", str(n) if n else "N", sys.argv[0] or "train.py",
                          *argv])
        raise ConfigError(f"train.py was started without torchrun, as a world of 1 rank, and this config is for more: {exc}; "
                          f"run it under torchrun: {cmd}") from None


def _suggest_nproc(cfg: JobConfig) -> Optional[int]:
    """The smallest world this config is valid for, preferring the one without accumulation."""
    t, p = cfg.training, cfg.parallelism
    candidates = [t.global_batch_size // t.local_batch_size] if t.global_batch_size > 0 else []
    if p.paro_group_size > 1:
        candidates += [2 * p.paro_group_size, p.paro_group_size]
    for n in candidates + [4, 2, 8]:
        if n >= 2:
            try:
                validate(cfg, n, n)
                return n
            except ConfigError:
                pass
    return None


def _check_hf_folder(cfg: JobConfig) -> None:
    from paro_fsdp.integrations.hf import HFModelError, read_config, weight_files

    try:
        read_config(cfg.model.hf_path)
        weight_files(cfg.model.hf_path)
    except HFModelError as exc:
        raise ConfigError(str(exc)) from None


def _hf_loss() -> Any:
    from paro_fsdp.train.hf_model import loss

    return loss


def _hf_architecture(model: torch.nn.Module) -> str:
    from paro_fsdp.train.hf_model import architecture

    return architecture(model)


def _error_line(message: str) -> None:
    """``train.py: error: <message>`` on stderr in one ``write`` of the whole line: survivors of a
    lost peer all report at once, and ``print`` (two writes, unbuffered under torchrun's
    ``PYTHONUNBUFFERED``) let two ranks' lines run together. One write to a pipe of at most
    PIPE_BUF (4096) bytes is never interleaved; the message is cut below that."""
    sys.stdout.flush()
    sys.stderr.flush()
    line = " ".join(f"train.py: error: {message}".split("\n"))[:3000] + "\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # stderr replaced in-process (a capture)
        sys.stderr.write(line)
        sys.stderr.flush()
        return
    os.write(fd, line.encode("utf-8", "replace"))


def _leave(code: int) -> None:
    """End the process with ``code``. A process group that is still initialised here belongs to
    a run that failed (``Trainer.close(failed=True)`` leaves it: a peer may be gone): tearing it
    down in the interpreter's exit can block on that peer or abort the process from a backend
    thread (``terminate called without an active exception``, SIGABRT instead of the exit
    status), so such a process leaves with ``os._exit`` once its output is flushed."""
    if dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _timeout_of(trainer: Optional[Trainer]) -> float:
    if trainer is None:
        return 0.0
    c = trainer.cfg.comm
    return c.train_timeout_seconds if trainer.state.step > (trainer.resumed_from or 0) + 1 else c.init_timeout_seconds


def _run_as_script() -> None:
    """``main`` as the process: the exit status, or a bug's traceback and status 1, through
    ``_leave`` (never a teardown of a failed process group)."""
    try:
        code = main(as_script=True)
    except SystemExit as exc:  # an explicit exit keeps its status
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: its traceback must be seen, then leave
        traceback.print_exc()
        code = 1
    _leave(code)


if __name__ == "__main__":
    _run_as_script()
