"""Run a function on N local gloo ranks in fresh processes and collect every rank's result.

Why one module: the local CPU calibration (``tools.calibrate --nproc``), ``tools.bench.advisor_check``
and the tests' worlds (``tests/harness/dist_harness.py``) all need the same few lines (a free port, one
spawned process per rank, results through a queue read before join, one failure fails the
world); they were written twice. Process start costs seconds per rank on a small machine, so
callers run many cases inside one world.

Ranks are forked from one fork server per parent process that has torch imported once: a spawned
rank spent ~2 s importing torch, a 4-rank world 8 s on 2 cores; forked, 0.2 s. The server runs
with ``OMP_NUM_THREADS=1``, as the ranks do, and a rank takes the parent's environment as it is
when the world starts (not as it was when the server started).
"""
from __future__ import annotations

import importlib
import io
import os
import socket
import traceback
from typing import Any
from unittest import mock

__all__ = ["run_local_world"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once in the fork server; what a rank needs beyond them it imports itself
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "paro_fsdp"]


def _context() -> Any:
    """The multiprocessing context ranks start from: a fork server with ``PRELOAD`` imported."""
    import multiprocessing.forkserver

    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, OMP_NUM_THREADS="1"):  # read once, when the server's OpenMP runtime loads
        multiprocessing.forkserver.ensure_running()
    return ctx


def _worker(rank: int, world: int, port: int, target: str, payload: Any, queue: Any, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        module, fn = target.split(":")
        result = getattr(importlib.import_module(module), fn)(payload)
        buf = io.BytesIO()
        torch.save(result, buf)  # tensors by value: shared memory dies with the worker
        queue.put((rank, "ok", buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_local_world(world: int, target: str, payload: Any = None, timeout: float = 900) -> list[Any]:
    """Run ``module:function(payload)`` on ``world`` local gloo ranks (CPU, one thread each);
    return every rank's result, in rank order.

    A rank that dies (a signal, an abort) or raises fails the world with RuntimeError: nothing
    is retried."""
    import torch

    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world, port, target, payload, queue, env)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 5)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
    if errors:
        errors.append(f"rank exit codes: {codes}")
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
