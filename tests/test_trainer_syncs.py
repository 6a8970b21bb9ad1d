"""The training loop stays free of host-device synchronisations between log steps.

On CUDA a ``.item()``, ``float(t)``, ``bool(t)``, ``t.tolist()`` or ``torch.cuda.synchronize()``
stalls the host until the GPU has caught up, so the next step's kernels are no longer queued
behind the current ones. The trainer keeps loss and grad norm as device tensors and reads them
(and the CUDA step-time events) once per log window. The one read allowed on every step is the
non-finite check (faults.py), which must decide before the optimizer steps. No GPU here: the debug trainer runs on one
CPU rank in this process with those calls replaced by counting wrappers, each call attributed to
the step running when it happened.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STEPS, LOG_FREQ = 7, 3
ARGV = ["--model.flavor", "debug", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "4", "--training.mixed_precision_param", "float32",
        "--training.mixed_precision_reduce", "float32", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2",
        "--training.max_norm", "1.0", "--parallelism.paro_strategy", "IIG", "--parallelism.paro_group_size", "1",
        "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false", "--comm.backend", "gloo",
        "--training.steps", str(STEPS)]
# Tensor methods that, on a CUDA tensor, wait for the GPU to finish the work queued before them
SYNCING = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
GUARD = "Tensor.__bool__ at faults.py"  # NonFiniteGuard.allows_step: one 2-element read per step


def _one_rank_env(monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)


def _count_syncs(monkeypatch, trainer_ref: list) -> dict[int, list[str]]:
    """Replace the syncing calls by wrappers that record (step running, call, caller)."""
    calls: dict[int, list[str]] = defaultdict(list)

    def host_only(tensor) -> bool:
        # torch.optim's Adam keeps its step counters on the CPU on CUDA too (capturable=False,
        # not fused) and reads them with .item() every step: no sync
        if tensor is None or not trainer_ref:
            return False
        return any(tensor is state.get("step") for state in trainer_ref[0].optimizer.state.values())

    def record(name: str, tensor=None) -> None:
        if host_only(tensor):
            return
        stack = traceback.extract_stack()[:-2]
        caller = stack[-1]
        step = trainer_ref[0].state.step if trainer_ref else 0
        where = next((f for f in reversed(stack) if "torch" + os.sep not in f.filename), caller)
        calls[step].append(f"{name} at {Path(where.filename).name}:{where.lineno} ({where.name})")

    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, __name=name, __original=original, **kwargs):
            record(f"Tensor.{__name}", self)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    original_sync = torch.cuda.synchronize

    def synchronize(*args, **kwargs):
        record("torch.cuda.synchronize")
        return original_sync(*args, **kwargs) if torch.cuda.is_available() else None

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return calls


def _train(argv: list[str], monkeypatch, count: bool):
    import torch.distributed as dist

    from paro_fsdp.train.config_parse import parse_args
    from train import Trainer

    _one_rank_env(monkeypatch)
    cfg, _ = parse_args(ARGV + argv)
    trainer_ref: list = []
    with monkeypatch.context() as m:
        calls = _count_syncs(m, trainer_ref) if count else {}
        trainer = Trainer(cfg)
        try:
            trainer_ref.append(trainer)
            losses = trainer.train()
        finally:
            trainer.close()
    assert not dist.is_initialized()
    return trainer, losses, calls


def test_no_device_sync_outside_log_steps(tmp_path, monkeypatch):
    dump = str(tmp_path / "run")
    trainer, losses, calls = _train(["--metrics.log_freq", str(LOG_FREQ), "--job.dump_folder", dump], monkeypatch, True)
    log_steps = {s for s in range(1, STEPS + 1) if s % LOG_FREQ == 0 or s == STEPS}
    for s in range(1, STEPS + 1):  # the non-finite check, once per step
        assert sum(c.startswith(GUARD) for c in calls.get(s, [])) == 1, (s, calls.get(s))
    calls = {s: [c for c in v if not c.startswith(GUARD)] for s, v in calls.items()}
    during = {s: v for s, v in calls.items() if 1 <= s <= STEPS and s not in log_steps and v}
    assert not during, "syncing calls on non-log steps:\n" + "\n".join(
        f"step {s}: {len(v)} calls, e.g. {sorted(set(v))[:8]}" for s, v in sorted(during.items()))
    # each log step reads its window once: loss and grad norm of every step in one transfer
    for s in log_steps:
        assert [c.split(" at ")[0] for c in calls.get(s, [])] == ["Tensor.tolist"], (s, calls.get(s))
    # the public result is unchanged: a float loss for every step, the same as when logging every step
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(type(v) is float for v in losses.values())
    lines = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == sorted(log_steps)
    assert [x["loss/train"] for x in lines] == [losses[s] for s in sorted(log_steps)]
    _, every, _ = _train(["--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path / "every")], monkeypatch, False)
    assert every == losses  # bit-identical: only when the values are read changed
