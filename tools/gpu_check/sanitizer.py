"""Part (e), CUDA only: torch's CUDA sanitizer over one strategy of each level, the synchronising
calls of a training step, and the caching allocator's reserved bytes beside its allocated ones.

* ``TORCH_CUDA_SANITIZER=1`` (``torch.cuda._sanitizer``) records, for every kernel torch
  dispatches, which tensors it reads and writes on which stream, and every event record, wait and
  synchronisation, and raises at the first access from one stream to a tensor last written or read
  on another without an ordering between them. It is per process and pure Python, so the four
  ranks of part (d)'s stand-in world (spawned, the variable set before they import torch) each run
  it: NNN, IIG and GGG train there, eagerly (it cannot see inside compiled kernels). To the
  sanitizer a collective is one kernel on the stream that issued it (the stand-in's own copies on
  its internal streams run inside that op, where the sanitizer does not look, as NCCL's would be),
  so what it checks is the engine's side of the protocol: side stream after compute stream at the
  issue, consumer after the side stream's event. Self-test: the same run with part (d)'s planted
  missing wait must make it report a race.
* ``torch.cuda.set_sync_debug_mode("warn")`` from the second step on: every synchronising call
  warns; the only one expected is the trainer's non-finite guard (``train/faults.py``
  ``NonFiniteGuard.allows_step``, one device-to-host read per step), which the runs use as
  ``train.py`` does. The stand-in's own host phase is exempt (NCCL has none).
* ``torch.cuda.max_memory_reserved()`` beside ``max_memory_allocated()`` per run (rank 0).

On CPU every row is SKIP: the sanitizer, the sync debug mode and the caching allocator are CUDA's;
the code paths stay importable and their pure parts are tested on CPU.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Optional

from .checks import FAIL, PASS, SKIP, STREAMS_TOL, check, classify_syncs
from .report import Emitter, fmt_bytes

STRATEGIES = ("NNN", "IIG", "GGG")  # one per level
SELF_TEST = ("IIG", "missing-wait")
GUARD_FILE = "paro_fsdp/train/faults.py"  # NonFiniteGuard.allows_step: the one expected synchronisation
SYNC_FROM_STEP = 1  # 0-based: from the second step on (the first allocates, compiles nothing, warms up)
SYNC_MESSAGE = "synchronizing CUDA operation"
CHECKS = (("e.sanitizer", f"TORCH_CUDA_SANITIZER over {', '.join(STRATEGIES)}: no race, exact"),
          ("e.sanitizer.plant", f"self-test: the sanitizer reports a planted {SELF_TEST[1]} ({SELF_TEST[0]})"),
          ("e.sync", "sync debug mode 'warn' from step 2: only the non-finite guard's read"),
          ("e.memory", "max_memory_reserved beside max_memory_allocated (rank 0)"))
SKIP_WHY = ("needs CUDA: the sanitizer, the sync debug mode and the caching allocator are CUDA's "
            "(pure parts tested on CPU)")


class SyncCounter:
    """Turns the sync debug mode on at step ``from_step`` (``hook(step)`` is called before each
    step and once after the last) and records where each synchronising call was made."""

    def __init__(self, from_step: int, last_step: int, set_mode: Optional[Callable[[Any], None]] = None) -> None:
        self.from_step, self.last_step = from_step, last_step
        self._set_mode = set_mode
        self._catch: Any = None
        self._log: list[Any] = []
        self.sites: list[tuple[str, int]] = []

    def set_mode(self, mode: Any) -> None:
        if self._set_mode is not None:
            self._set_mode(mode)
        else:
            import torch

            torch.cuda.set_sync_debug_mode(mode)

    def hook(self, step: int) -> None:
        if step == self.from_step:
            self._catch = warnings.catch_warnings(record=True)
            self._log = self._catch.__enter__()
            warnings.simplefilter("always")
            self.set_mode("warn")
        elif step == self.last_step and self._catch is not None:
            self.set_mode(0)
            self._catch.__exit__(None, None, None)
            self._catch = None
            self.sites = [(w.filename, w.lineno) for w in self._log if SYNC_MESSAGE in str(w.message)]


def rank_main(payload: dict[str, Any], send: Callable[[Any], None]) -> dict[str, Any]:
    """Part (e) inside a rank: each case under the sanitizer (enabled at this process's import of
    torch); a sanitizer error ends the rank's cases (the ranks may be out of step after it)."""
    import torch
    from torch.cuda import _sanitizer as csan
    from torch.distributed.device_mesh import init_device_mesh

    from paro_fsdp.train.faults import NonFiniteGuard

    from .plants import planted
    from .ranks import rank_device
    from .standin import StandIn
    from .workload import STEPS, train_sharded

    device = rank_device("cuda")
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("inter", "intra"))
    StandIn("cuda").install()
    enabled = bool(csan.cuda_sanitizer.enabled)
    for case in payload["cases"]:
        t0 = time.monotonic()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        counter = SyncCounter(SYNC_FROM_STEP, STEPS)
        try:
            with planted(case.get("plant"), "cuda"):
                out = train_sharded(mesh, case["strategy"], device, step_hook=counter.hook,
                                    guard=NonFiniteGuard("skip", 0))
        except Exception as exc:  # noqa: BLE001 - the sanitizer's error (or any other) is the case's result
            counter.hook(STEPS)
            send({"case": case["id"], "seconds": time.monotonic() - t0, "sanitizer": enabled,
                  "error": f"{type(exc).__name__}: {_first_lines(exc)}", "race": "CUDASanitizer" in type(exc).__name__})
            break
        send({"case": case["id"], "seconds": time.monotonic() - t0, "sanitizer": enabled, "race": False,
              "syncs": counter.sites, "allocated": torch.cuda.max_memory_allocated(),
              "reserved": torch.cuda.max_memory_reserved(), **out})
    return {"sanitizer": enabled}


def _first_lines(exc: BaseException, n: int = 3) -> str:
    errors = getattr(exc, "errors", None)
    text = str(errors[0]) if errors else str(exc)
    return " | ".join(ln.strip() for ln in text.strip().splitlines()[:n])[:400]


# ---- judging ------------------------------------------------------------------------------------------
def judge_sanitizer(cases: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """No race, the sanitizer on in every rank, every strategy exact."""
    off = [cid for cid, c in cases.items() for r in c["ranks"].values() if not r.get("sanitizer")]
    bad = [(cid, c) for cid, c in cases.items() if not c["ok"]]
    parts = [f"sanitizer on in every rank of {len(cases)} runs" if not off else f"sanitizer OFF in {sorted(set(off))}"]
    parts += [f"{cid}: {c.get('error') or 'not exact'}" for cid, c in bad]
    if not bad:
        parts.append("no race reported, all exact (worst param diff "
                     f"{max(c['param_diff'] for c in cases.values()):.1e})")
    return (PASS if not off and not bad else FAIL), "; ".join(parts)


def judge_self_test(case: dict[str, Any]) -> tuple[str, str]:
    races = sorted(rank for rank, r in case["ranks"].items() if r.get("race"))
    if races:
        return PASS, f"reported (rank {', '.join(map(str, races))}): {case['ranks'][races[0]]['error']}"
    return FAIL, "no race reported: " + (case.get("error") or "the planted run finished without a sanitizer error")


def judge_syncs(cases: dict[str, dict[str, Any]], steps_on: int) -> tuple[str, str]:
    """Every rank of every run: exactly one guard read per step with the mode on, nothing else."""
    worst: dict[str, Any] = {"expected": steps_on, "unexpected": 0, "sites": {}}
    ok = True
    for c in cases.values():
        for r in c["ranks"].values():
            got = classify_syncs([tuple(s) for s in r.get("syncs", [])], GUARD_FILE)
            if got["unexpected"] or got["expected"] != steps_on:
                ok = False
                if got["unexpected"] >= worst["unexpected"]:
                    worst = got
    if ok:
        return PASS, f"{steps_on} per run and rank, all from the non-finite guard ({GUARD_FILE})"
    sites = ", ".join(f"{k} x{v}" for k, v in sorted(worst["sites"].items())[:5])
    return FAIL, f"guard reads {worst['expected']} (expected {steps_on}), other syncs {worst['unexpected']}: {sites}"


def judge_memory(cases: dict[str, dict[str, Any]]) -> tuple[str, str]:
    rows, ok = [], True
    for cid, c in cases.items():
        r = c["ranks"].get(0, next(iter(c["ranks"].values())))
        alloc, reserved = r.get("allocated", 0), r.get("reserved", 0)
        ok = ok and 0 < alloc <= reserved
        rows.append(f"{cid} allocated {fmt_bytes(alloc)}, reserved {fmt_bytes(reserved)}")
    return (PASS if ok and rows else FAIL), "; ".join(rows) or "no run finished"


# ---- the parent ----------------------------------------------------------------------------------------
RANK_TARGET = "tools.gpu_check.sanitizer:rank_main"


def worker_e(emit: Emitter, device: str, timeout_s: float) -> None:
    """Part (e): SKIP rows on CPU; on CUDA ``run_part_e``."""
    if device != "cuda":
        for cid, name in CHECKS:
            emit(check("e", cid, name, SKIP, SKIP_WHY))
        return
    run_part_e(emit, timeout_s)


def run_part_e(emit: Emitter, timeout_s: float, device: str = "cuda", target: str = RANK_TARGET,
               sanitize: bool = True) -> None:
    """The reference on ``device``, then the four ranks of ``target`` (spawned with
    ``TORCH_CUDA_SANITIZER=1`` when ``sanitize``), their rows as their runs finish. ``device``,
    ``target`` and ``sanitize`` are for the CPU test of this plumbing (a rank with CUDA faked)."""
    from .ranks import MARGIN_S, Row, Tracker
    from .workload import STEPS, WORLD, reference
    from .world import run_world

    t0 = time.monotonic()
    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
    ref = reference(device)
    if sanitize:
        os.environ["TORCH_CUDA_SANITIZER"] = "1"  # read by the spawned ranks' import of torch
    cases = [{"id": s, "strategy": s} for s in STRATEGIES] + [
        {"id": f"{SELF_TEST[0]}+{SELF_TEST[1]}", "strategy": SELF_TEST[0], "plant": SELF_TEST[1]}]
    normal = [c["id"] for c in cases[:-1]]
    names = dict(CHECKS)
    rows = [Row("e.sanitizer", names["e.sanitizer"], normal, lambda row, done: judge_sanitizer({k: done[k] for k in row.cases})),
            Row("e.sync", names["e.sync"], normal,
                lambda row, done: judge_syncs({k: done[k] for k in row.cases}, STEPS - SYNC_FROM_STEP)),
            Row("e.memory", names["e.memory"], normal, lambda row, done: judge_memory({k: done[k] for k in row.cases})),
            Row("e.sanitizer.plant", names["e.sanitizer.plant"], [cases[-1]["id"]],
                lambda row, done: judge_self_test(done[row.cases[0]]))]
    tracker = Tracker("e", rows, emit, ref, STREAMS_TOL[device], WORLD)
    left = timeout_s - (time.monotonic() - t0) - MARGIN_S
    outcome = run_world(WORLD, target, {"cases": cases}, device, left, tracker.on_message, enough=tracker.all_emitted)
    print(f"world of {len(cases)} cases: {'done' if outcome.done else outcome.why()} in {outcome.seconds:.1f} s", flush=True)
    tracker.finish([c["id"] for c in cases], outcome.why())
