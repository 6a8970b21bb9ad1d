"""The plan (paro_fsdp/plan.py) is what runs: for all 27 strategies, the collectives the engine
issues in a step, in order, on one rank of a fake 2 x 2 world, equal the plan's phases expanded
as PaRO-CC runs a global collective; the ledger counts the same plan; the overlap's process
groups are the plan's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from paro_fsdp import paro_shard
from paro_fsdp.collectives import HIER, USED, CommStats, Dim
from paro_fsdp.comm import MeshComm
from paro_fsdp.cost.ledger import Bucket, traffic_of
from paro_fsdp.overlap import forward_dims, push_dims
from paro_fsdp.plan import plan_of
from paro_fsdp.strategy import ALL_STRATEGIES
from paro_fsdp.train.estimate import fake_mesh, release_fake_world

def expand(moves) -> list[tuple[str, str]]:
    """A global move as PaRO-CC's phases (never flat here: flat_below_bytes = 0)."""
    out: list[tuple[str, str]] = []
    for m in moves:
        out += HIER[m.kind] if m.dim == Dim.GLOBAL else [(m.kind, m.dim)]
    return out


@pytest.fixture(scope="module")
def mesh():
    yield fake_mesh(4, 2)
    release_fake_world()


@pytest.fixture
def recorded(monkeypatch):
    log: list[tuple[str, str]] = []
    count = MeshComm._count

    def record(self, kind, dim, numel, t):
        log.append((kind, dim))
        count(self, kind, dim, numel, t)

    monkeypatch.setattr(MeshComm, "_count", record)
    return log


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_engine_runs_the_plan(mesh, recorded, strategy):
    """Two micro-steps (the first without gradient sync), the optimizer step, the next forward:
    gather, reduce, gather, reduce, boundary, the end of backward's question which tensors some
    rank used (one global all-reduce), push (issued by the next forward), gather; nothing else."""
    torch.manual_seed(0)
    model = paro_shard(nn.Linear(8, 8), mesh, strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    recorded.clear()
    for micro, sync in enumerate((False, True)):
        model.set_requires_gradient_sync(sync)
        model(x).sum().backward()
    opt.step()
    model(x)
    plan = plan_of(strategy)
    g, r, b, p = (expand(plan.phase(name)) for name in ("gather", "reduce", "boundary", "push"))
    assert recorded == g + r + g + r + b + [USED] + p + g, plan


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_ledger_and_overlap_read_the_plan(strategy):
    """The ledger's counts per phase are the plan's moves (a global one as its two or three
    phases), and the overlap's process groups are the plan's."""
    plan = plan_of(strategy)
    stats = traffic_of([Bucket(plan.strategy, 1024, 1024, gathers=1)], n=4, m=2, grad_accum=1)
    want = CommStats()
    for kind, dim in expand(plan.gather + plan.reduce + plan.boundary + plan.push):
        want.record(kind, dim, 0)
    assert {k: v["count"] for k, v in stats.as_dict().items()} == {k: v["count"] for k, v in want.as_dict().items()}


def test_overlap_dims_are_the_plans(mesh):
    for strategy in ("NIG", "IIG", "NNG", "GGG"):
        group = paro_shard(nn.Linear(8, 8), mesh, strategy)._paro_state.groups[0]
        assert push_dims(group) == group.plan.dims("push")
        assert forward_dims(group) == group.plan.dims("gather")
    assert plan_of("NIG").dims("push") == {"inter", "intra", "global"}
    assert plan_of("IIG").dims("push") == {"inter"} and plan_of("GGG").dims("push") == set()
