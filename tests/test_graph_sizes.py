"""The passes price an all-reduce node by its group's size, which the node only names
(``all_reduce(x, op, group_name)``), unlike all-gather and reduce-scatter nodes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from passes.graph import group_size_of


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def test_group_size_of_every_collective_kind(fake_world):
    quad = dist.new_group([0, 1, 2, 3])
    ops = torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    gather = g.call_function(ops.all_gather_into_tensor.default, (x, 4, quad.group_name))
    scatter = g.call_function(ops.reduce_scatter_tensor.default, (x, "sum", 4, quad.group_name))
    reduce = g.call_function(ops.all_reduce.default, (x, "sum", quad.group_name))
    world = g.call_function(ops.all_reduce.default, (x, "sum", dist.group.WORLD.group_name))
    assert [group_size_of(gather, "all_gather"), group_size_of(scatter, "reduce_scatter"),
            group_size_of(reduce, "all_reduce"), group_size_of(world, "all_reduce")] == [4, 4, 4, 8]
