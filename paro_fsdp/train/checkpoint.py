"""Checkpoints with torch.distributed.checkpoint (DCP): atomic saves, pruning, resume.

A ``step-<N>`` folder's keys: docs/trainer.md. Why DTensors by name (as FSDP2's): DCP reads what the
*loading* run's placements need (IIG on 4 ranks loads under GGG on 2), and folders interchange with
torchtitan's. Why atomic: ``step-<N>.tmp`` is renamed into place once every rank finished. Why verified: a
manifest of sizes and CRC32s and a shape check stop a damaged or foreign checkpoint with one line. Why
damage is moved aside (``step-<N>.damaged``): skipping it would resume earlier and overwrite the evidence.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim.lr_scheduler import LambdaLR

from ..checkpoint_files import (MANIFEST, CheckpointError, SafeReader, disk_failure, first_line, safe_load,
                               shape_problem, verify, write_manifest)

_STEP_DIR = re.compile(r"^step-(\d+)$")
MODEL_SCOPE = "model."  # this trainer's checkpoints: the model's parameters under model.<fqn>
LEGACY_SCOPE = "optimizer.master."  # before the FSDP2 contract: the fp32 masters under the ParoOptimizer's state
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # optimizer.state.<fqn>.<key>: any param grouping loads


class ModelState:
    """The model's parameters by FQN: the fp32 masters at the OS level (frozen ones at P); buffers
    (RoPE tables) are rebuilt by the model, not saved."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        buffers = {name for name, _ in self.model.named_buffers(remove_duplicate=False)}
        return {k: v for k, v in get_model_state_dict(self.model).items() if k not in buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # not strict: the buffers are not in it; every parameter is (shape_problem checked that)
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=False))


class OptimizerState:
    """The optimizer's state keyed by parameter name and flattened, as torchtitan's."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=_FLAT)


class SchedulerState:
    """The lr scheduler as a DCP Stateful: only its step counter, the curve comes from the config."""

    def __init__(self, scheduler: LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": int(self.scheduler.last_epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.scheduler
        s.last_epoch = int(state["last_epoch"])
        s._step_count = s.last_epoch + 1  # noqa: SLF001 - keeps LambdaLR's "step() before optimizer" check quiet
        lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs  # noqa: SLF001


class TrainState:
    """Step counter and RNG states (identical on every rank: the trainer seeds them alike)."""

    def __init__(self, device: torch.device) -> None:
        self.step = 0
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "rng_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["rng_cpu"].cpu())
        if "rng_cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"].cpu(), self.device)


def scan_checkpoints(folder: str) -> tuple[dict[int, str], dict[int, tuple[str, str]]]:
    """``step-<N>`` entries: (complete, with DCP's ``.metadata``: step -> path; damaged: step -> (path, why))."""
    complete: dict[int, str] = {}
    damaged: dict[int, tuple[str, str]] = {}
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            m = _STEP_DIR.match(name)
            if not m:
                continue
            path = os.path.join(folder, name)
            if not os.path.isdir(path):
                damaged[int(m.group(1))] = (path, "not a folder")
            elif not os.path.isfile(os.path.join(path, ".metadata")):
                damaged[int(m.group(1))] = (path, "no .metadata: DCP cannot load it")
            else:
                complete[int(m.group(1))] = path
    return dict(sorted(complete.items())), dict(sorted(damaged.items()))


def list_checkpoints(folder: str) -> dict[int, str]:
    return scan_checkpoints(folder)[0]


def move_aside(path: str) -> str:
    """Rename ``path`` to ``<path>.damaged`` (``-2``, ... if taken): out of every listing, kept for inspection."""
    target, n = f"{path}.damaged", 1
    while os.path.lexists(target):
        n += 1
        target = f"{path}.damaged-{n}"
    os.rename(path, target)
    return target


class CheckpointManager:
    """Saves every ``interval`` steps and the last, prunes to ``keep_latest_k``, resumes from the latest."""

    def __init__(self, folder: str, interval: int, keep_latest_k: int, enabled: bool, states: dict[str, Any],
                 verify: bool = True) -> None:
        self.folder, self.interval, self.keep_latest_k, self.enabled = folder, interval, keep_latest_k, enabled
        self.states, self.verify = states, verify
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.removed: list[str] = []  # leftovers of a save (or prune) that crashed, removed here
        self.notes: list[str] = []  # one line each, for the log: damaged folders moved aside, steps a resume replaces
        if self.enabled and self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            for name in sorted(os.listdir(self.folder)):
                if name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
                    self.removed.append(name)
            for path, why in scan_checkpoints(self.folder)[1].values():
                self.notes.append(f"checkpoint {path} is damaged ({why}): not loaded; moved aside to "
                                  f"{move_aside(path)} so that no save overwrites it")
        self._barrier()

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def load(self, step: int = -1) -> Optional[int]:
        """Load the checkpoint of ``step`` (-1: the latest); return its step, or None if there is none."""
        if not self.enabled:
            return None
        found = list_checkpoints(self.folder)
        if step == -1:
            if not found:
                return None
            step = max(found)
        elif step not in found:
            raise FileNotFoundError(f"checkpoint.load_step = {step}: no complete checkpoint of that step in "
                                    f"{self.folder}; valid: -1 or one of {sorted(found)}")
        path = found[step]
        earlier = [s for s in found if s < step]
        damage_fix = (f"; load an earlier one with --checkpoint.load_step {max(earlier)} (complete: {earlier}), "
                      f"or move {path} away" if earlier else f"; move {path} away to start from step 0")
        later = [s for s in found if s > step]
        if later:
            names = ", ".join(f"step-{s}" for s in later)
            self.notes.append(f"checkpoint.load_step {step}: the later checkpoints {names} in {self.folder} will be "
                              f"overwritten or pruned as this run saves (move them away to keep them)")
        unverified_fix = "; load it unverified with --checkpoint.verify false, or " + (
            f"load an earlier one with --checkpoint.load_step {max(earlier)}" if earlier
            else f"move {path} away to start from step 0")
        misfit_fix = (f"; use the model options of the run that wrote it ({_MODEL_KEYS}), or set job.dump_folder to "
                      f"another folder to train this model from step 0 (an earlier step of that run has the same "
                      f"shapes)")

        def target(metadata):
            if "model" in self.states and _is_legacy(metadata):
                raise CheckpointError(
                    f"checkpoint {path} was written before the trainer's optimizer became torch's over the model's "
                    f"parameters (its weights are under {LEGACY_SCOPE}*, this trainer's under {MODEL_SCOPE}*): it "
                    f"cannot be resumed; start from its weights with --checkpoint.initial_load_path {path} "
                    f"(optimizer, lr schedule and data from step 0) and set job.dump_folder to another folder")
            return self.states, MODEL_SCOPE

        _checked_load(path, target, self.verify, f"checkpoint {path}",
                      damage_fix=damage_fix, misfit_fix=misfit_fix, unverified_fix=unverified_fix, warn=None)
        return step

    def latest_hint(self) -> str:
        found = list_checkpoints(self.folder) if self.enabled else {}
        if not found:
            return "there is no complete checkpoint yet"
        return f"the latest complete checkpoint is {found[max(found)]}"

    def should_save(self, step: int, last_step: int) -> bool:
        return self.enabled and (step % self.interval == 0 or step == last_step)

    def save(self, step: int) -> str:
        """Write ``step-<step>`` atomically, then prune. Every rank must call it."""
        final = os.path.join(self.folder, f"step-{step}")
        tmp = final + ".tmp"
        hint = self.latest_hint()
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            self._barrier()
            dcp.save(self.states, checkpoint_id=tmp)  # raises on every rank if any rank's write failed
            write_manifest(tmp, step)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises a BaseException
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if not disk_failure(exc):
                raise  # a lost peer or a bug: reported as such, not as a disk problem
            raise CheckpointError(f"saving checkpoint step-{step} in {self.folder} failed: "
                                  f"{first_line(exc, prefer=OSError)}; {hint} and stays loadable; free space there or "
                                  f"set job.dump_folder to a larger disk") from None
        self._barrier()  # every rank's shards are on disk; rank 0 already wrote .metadata and the manifest
        if self.rank == 0:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            if self.keep_latest_k > 0:
                steps = sorted(list_checkpoints(self.folder))
                for old in steps[: -self.keep_latest_k]:  # renamed first: a half-deleted folder is never "complete"
                    doomed = os.path.join(self.folder, f"step-{old}.tmp")
                    os.rename(os.path.join(self.folder, f"step-{old}"), doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
        self._barrier()
        return final


def build_checkpointer(cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: LambdaLR,
                       data: Any, state: TrainState) -> CheckpointManager:
    """``[checkpoint]``'s manager over the run's states: model, optimizer, lr schedule, data position, step."""
    c = cfg.checkpoint
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
              "lr_scheduler": SchedulerState(lr_scheduler), "dataloader": data, "train_state": state}
    return CheckpointManager(os.path.join(cfg.job.dump_folder, c.folder), c.interval, c.keep_latest_k, c.enable,
                             states=states, verify=c.verify)


def start_afresh(cfg: Any, rank: int) -> list[str]:
    """``job.fresh``: rank 0 deletes what a previous run wrote in the dump folder, and nothing else: never the
    dump folder or one holding it (``checkpoint.folder = "."`` must not wipe a home). Returns what it removed."""
    removed = []
    if rank == 0:
        dump = os.path.realpath(cfg.job.dump_folder)
        for name in (cfg.checkpoint.folder, cfg.metrics.save_tb_folder, cfg.profiling.save_traces_folder, "compile",
                     "metrics.jsonl"):
            path = os.path.realpath(os.path.join(dump, name))
            if (not os.path.lexists(path) or os.path.commonpath([path, dump]) == path
                    or path == os.path.realpath(os.getcwd())):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(path)
    dist.barrier()
    return removed


_MODEL_KEYS = "model.flavor, model.tokenizer, model.vocab_size"  # what decides a checkpoint's shapes


def load_model_weights(model: torch.nn.Module, path: str, verify_files: bool = True,
                       warn: Optional[Callable[[str], None]] = None) -> str:
    """Model weights from a ``step-N`` folder (``model.<fqn>``, or the legacy ``optimizer.master.<fqn>``) or one
    keyed by parameter names (torchtitan's model-only); returns which. No manifest: one ``warn`` line. Collective."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"checkpoint.initial_load_path = {path!r} is not a DCP checkpoint folder (no .metadata); "
                              f"valid: a folder written by torch.distributed.checkpoint, e.g. a step-N folder")
    weights = ModelState(model).state_dict()  # parameters only: buffers such as RoPE tables are rebuilt
    own = [""]

    def target(metadata):
        if _is_own(metadata):  # this trainer's checkpoint: model.<fqn>
            own[0] = "the fp32 masters of a paro-fsdp checkpoint"
            return {"model": weights}, MODEL_SCOPE
        if _is_legacy(metadata):  # an earlier paro-fsdp's: the trainable masters under optimizer.master.<fqn>
            own[0] = f"the fp32 masters of an earlier paro-fsdp checkpoint ({LEGACY_SCOPE}*)"
            trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
            return {"optimizer": {"master": {k: v for k, v in weights.items() if k in trainable}}}, LEGACY_SCOPE
        return weights, ""  # parameter-name keys

    _checked_load(path, target, verify_files, f"checkpoint.initial_load_path {path}",
                  damage_fix="; point checkpoint.initial_load_path at an intact checkpoint folder, or leave it empty",
                  misfit_fix=f"; point it at a checkpoint of this model, or use the model options of the run that "
                             f"wrote it ({_MODEL_KEYS})",
                  unverified_fix=None, warn=warn or (lambda line: warnings.warn(line, stacklevel=3)))
    ModelState(model).load_state_dict(weights)
    return own[0] or "model weights"


def _is_own(metadata: Any) -> bool:
    """This trainer's (its train state beside the model), not a model-only folder whose names start ``model.``."""
    keys = metadata.state_dict_metadata
    return "train_state.step" in keys and any(k.startswith(MODEL_SCOPE) for k in keys)


def _is_legacy(metadata: Any) -> bool:
    keys = metadata.state_dict_metadata
    return any(k.startswith(LEGACY_SCOPE) for k in keys) and not any(k.startswith(MODEL_SCOPE) for k in keys)


def _checked_load(path: str, target: Callable[[Any], tuple[Any, str]], verify_files: bool, what: str, *,
                  damage_fix: str, misfit_fix: str, unverified_fix: Optional[str],
                  warn: Optional[Callable[[str], None]]) -> None:
    """Verify, shape-check against ``target(metadata)``, ``safe_load``: each failure one line with its fix."""
    if verify_files and not os.path.isfile(os.path.join(path, MANIFEST)):
        if warn is None:
            raise CheckpointError(f"{what} has no {MANIFEST}, so its files cannot be verified (this trainer writes one "
                                  f"with every save: the folder was copied incompletely or written by another "
                                  f"tool){unverified_fix}")
        warn(f"{what} has no {MANIFEST} (folders written by torchtitan or plain DCP have none): its files could not be "
             f"verified against checksums; loading it, its shapes checked (--checkpoint.verify true)")
    problem = verify(path) if verify_files else None
    if problem:
        raise CheckpointError(f"{what} is damaged: {problem}{damage_fix}")
    reader = SafeReader(path)
    try:
        metadata = reader.read_metadata()
    except CheckpointError as exc:
        raise CheckpointError(f"{what} is refused: {exc}{damage_fix}") from None
    state, scope = target(metadata)
    # only the states under ``scope`` are shape-checked: asking a fresh optimizer for its state would initialise it
    top = scope.split(".")[0]
    problem = shape_problem(metadata, {top: state[top]} if top and top in state else {} if top else state, scope)
    if problem:
        raise CheckpointError(f"{what} does not fit this model: {problem}{misfit_fix}")
    try:
        safe_load(state, storage_reader=reader)
    except CheckpointException as exc:  # DCP wraps every rank's failure (ours included)
        raise CheckpointError(f"{what} failed to load: {first_line(exc)}{damage_fix}") from None
