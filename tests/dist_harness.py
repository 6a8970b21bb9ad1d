"""Run a function on N real gloo ranks in fresh processes, once per test module.

Process start costs seconds per rank here, so a module spawns its world once and runs every
case inside it; results come back from every rank through a queue (read before join).
"""
from __future__ import annotations

import importlib
import io
import os
import socket
import traceback
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, target: str, payload: Any, queue) -> None:
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


def run_world(world: int, target: str, payload: Any = None, timeout: float = 900) -> list[Any]:
    """Run ``module:function(payload)`` on ``world`` ranks; return every rank's result.

    A rank that dies (a signal, an abort) fails the world: nothing is retried."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, target, payload, queue)) for r in range(world)]
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
            import torch

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
