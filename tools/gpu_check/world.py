"""Several real gloo ranks on this machine for parts (d) and (e), with results streamed back as
each case finishes and a deadline.

Why not ``paro_fsdp.local_world.run_local_world``: that one returns only when every rank is done,
and on a failure waits up to 30 s per rank; a part under its own timeout must keep the cases that
finished and stop the rest at once. Ranks call ``send(obj)`` for each finished case; the parent
hands every message to ``on_message`` as it arrives, so it can report a row as soon as its cases
are in. On CUDA the ranks are *spawned* (fresh interpreters: a fork after anything touched the
CUDA driver breaks CUDA in the child); on CPU they fork from a fork server with torch imported
(as ``local_world``: 0.2 s for a world instead of seconds).
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional
from unittest import mock

#: how long the other ranks get to report after one rank failed, before the world is stopped
GRACE_S = 5.0


@dataclass
class WorldOutcome:
    """How a world ended: ``done`` (every rank returned), else ``errors`` (rank: traceback) or
    ``timed_out``; ``results``: what each finished rank returned."""

    done: bool
    timed_out: bool = False
    errors: dict[int, str] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def why(self) -> str:
        """One line for a row the world did not reach."""
        if self.timed_out:
            return f"not reached: the ranks ran past their deadline ({self.seconds:.0f} s)"
        if self.errors:
            rank, tb = sorted(self.errors.items())[0]
            last = [ln.strip() for ln in tb.strip().splitlines() if ln.strip()][-1:] or ["?"]
            return f"not reached: rank {rank} failed: {last[0][:300]}"
        return "not reached: the ranks did not report it"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(device: str) -> Any:
    import torch.multiprocessing as mp

    if device == "cuda":
        return mp.get_context("spawn")
    import multiprocessing.forkserver

    from tools.local_world import PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, OMP_NUM_THREADS="1"):
        multiprocessing.forkserver.ensure_running()
    return ctx


def _dump(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _rank(rank: int, world: int, port: int, target: str, payload: Any, q: Any, env: dict[str, str],
          timeout_s: float) -> None:
    os.environ.clear()  # a forked rank has the fork server's environment: the parent's, as it is now
    os.environ.update(env)
    # every rank drives the one GPU 0 (DeviceMesh would pick cuda:LOCAL_RANK otherwise)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the hostname resolves to offline
    try:
        import importlib

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        module, fn = target.split(":")
        result = getattr(importlib.import_module(module), fn)(payload, lambda obj: q.put((rank, "msg", _dump(obj))))
        q.put((rank, "done", _dump(result)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        q.put((rank, "error", traceback.format_exc()))


def run_world(world: int, target: str, payload: Any, device: str, deadline_s: float,
              on_message: Callable[[int, Any], None], collective_timeout_s: float = 300.0,
              enough: Optional[Callable[[], bool]] = None) -> WorldOutcome:
    """Run ``module:function(payload, send)`` on ``world`` gloo ranks; call ``on_message(rank,
    obj)`` for everything a rank sends, as it arrives. Stops every rank when all are done, when
    one fails (after ``GRACE_S`` for the others to report), when ``enough()`` says the parent has
    what it needs (checked after each message) or at ``deadline_s`` seconds."""
    t0 = time.monotonic()
    ctx = _context(device)
    q = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_rank, args=(r, world, port, target, payload, q, env, collective_timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    out = WorldOutcome(done=False)
    stop_at, stopped = t0 + deadline_s, False
    try:
        while len(out.results) < world:
            try:
                rank, kind, value = q.get(timeout=max(0.05, min(1.0, stop_at - time.monotonic())))
            except queue_mod.Empty:
                if time.monotonic() >= stop_at:
                    out.timed_out = not out.errors
                    break
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out.results]
                if dead and not out.errors:  # killed by a signal before it could report
                    out.errors.update({r: f"rank {r} died (exit code {procs[r].exitcode})" for r in dead})
                    stop_at = min(stop_at, time.monotonic() + GRACE_S)
                continue
            if kind == "msg":
                on_message(rank, _load(value))
                if enough is not None and enough():
                    out.done = stopped = True
                    break
            elif kind == "done":
                out.results[rank] = _load(value)
            else:
                out.errors[rank] = value
                stop_at = min(stop_at, time.monotonic() + GRACE_S)
        out.done = out.done or (len(out.results) == world and not out.errors)
    finally:
        for p in procs:
            p.join(timeout=5 if out.done and not stopped else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.seconds = time.monotonic() - t0
    return out
