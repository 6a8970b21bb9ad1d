"""A finished run exits cleanly: after the last step nothing of the engine's is in flight (the push to
P is queued and issued by the next forward, overlap.py) and nothing is issued at teardown, so
``dist.destroy_process_group`` is torch's own and a rank that exits first (no destroy, as a script
whose rank 0 exits after printing) leaves the others to end without an error (gloo's own teardown
race aside, which torch's FSDP2 shares: see the test). Each job is a real
``torchrun`` of 4 CPU ranks (2 groups of 2) training three models whose pushes cross groups (IIG,
NIG, NII: inter all-gathers) and one that pushes nothing (GGG)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = '''
import os, sys, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from paro_fsdp import fully_shard
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
for strategy in ("IIG", "NIG", "NII", "GGG"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh, strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
print(f"rank {dist.get_rank()} done", flush=True)
if os.environ.get("RANK0_EXITS") == "1" and dist.get_rank() == 0:
    sys.exit(0)  # no destroy_process_group: the others destroy theirs without it
dist.destroy_process_group()
'''
WARNINGS = ("unwaited collective", "terminate called", "Connection closed by peer", "Traceback")


def run_job(tmp_path: Path, rank0_exits: bool) -> tuple[int, str]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK0_EXITS": "1" if rank0_exits else "0",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script)], env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def check(rc: int, out: str) -> None:
    assert rc == 0, out[-4000:]
    assert sum(f"rank {r} done" in out for r in range(4)) == 4, out[-4000:]
    for warning in WARNINGS:
        assert warning not in out, (warning, out[-4000:])


def test_the_others_end_cleanly_when_rank_0_exits_first(tmp_path):
    """No rank raises at its ``destroy_process_group`` (before: every one, on the last step's push and the
    gloo barrier after it, "Connection closed by peer"). What may remain is gloo's own teardown race
    when a peer's sockets close under a rank's exit ("terminate called without an active exception",
    SIGABRT): torch's FSDP2 shows it in this same job as often as PaRO (1 in 8 each, measured), so it is
    told apart here, not counted as the engine's."""
    rc, out = run_job(tmp_path, rank0_exits=True)
    assert sum(f"rank {r} done" in out for r in range(4)) == 4, out[-4000:]
    assert not re.search(r"\[rank\d\]: .*(Error|Traceback)", out), out[-4000:]
    assert "unwaited collective" not in out, out[-4000:]
    if rc != 0:
        assert "terminate called without an active exception" in out, out[-4000:]


def test_a_finished_run_exits_with_nothing_in_flight(tmp_path):
    check(*run_job(tmp_path, rank0_exits=False))


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(20))
def test_twenty_short_jobs_exit_cleanly(tmp_path, attempt):
    check(*run_job(tmp_path, rank0_exits=False))
