"""What the graph passes count as compute, and which graphs their inductor settings reach.

Graphs are built by hand (the passes read only targets, users and metadata), or are tiny
functions compiled by inductor on a fake 8-rank world (extern kernels only: no C++ to build).
"""
from __future__ import annotations

import operator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.scheduler import Scheduler

import passes
from paro_fsdp.mesh import MeshInfo
from paro_fsdp.train.estimate import fake_mesh, release_fake_world
from passes.reorder import hoist_issues
from passes.schedule import schedule

_ops = torch.ops._c10d_functional
aten = torch.ops.aten

#: heavy ops of backward graphs (and the fused attention kernels of forward ones)
HEAVY = ["_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention_backward",
         "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_cudnn_attention_backward", "convolution_backward"]


def _heavy_op(name: str):
    if not hasattr(aten, name):
        pytest.skip(f"aten.{name} is not in torch {torch.__version__}")
    return getattr(aten, name).default


@pytest.mark.parametrize("name", HEAVY)
def test_backward_kernels_count_as_compute(name):
    """An attention (or convolution) backward between a reduce-scatter's issue and its wait is
    work that hides the transfer, and the reorder pass does not carry it along with the
    reduce-scatter it feeds as if it were a layout copy."""
    op = _heavy_op(name)
    g = fx.Graph()
    p = [g.placeholder(f"p{i}") for i in range(5)]
    early = g.call_function(_ops.reduce_scatter_tensor.default, (p[4], "sum", 2, "paro"))
    x = g.call_function(aten.mm.default, (p[0], p[1]))
    other = g.call_function(aten.mm.default, (p[2], p[3]))  # independent of the heavy op
    heavy = g.call_function(op, (x, x, x))
    grad = g.call_function(aten.view.default, (g.call_function(operator.getitem, (heavy, 0)), [-1]))
    rs = g.call_function(_ops.reduce_scatter_tensor.default, (grad, "sum", 2, "paro"))
    waits = [g.call_function(_ops.wait_tensor.default, (c,)) for c in (early, rs)]
    g.output((*waits, other))

    overlap = {e.issue: e.overlap for e in schedule(g, {})}
    order = list(g.nodes)
    assert overlap[order.index(early)] == 3  # two matmuls and the heavy op
    assert hoist_issues(g, {}) == 0  # the reduce-scatter already follows its real input
    assert list(g.nodes) == order


@pytest.fixture
def mesh():
    yield MeshInfo.from_mesh(fake_mesh(8, 4)).groups
    release_fake_world()


def _gather_mm(group: str):
    def f(x, w):
        gathered = _ops.all_gather_into_tensor.default(w, 4, group)
        return x @ _ops.wait_tensor.default(gathered)
    return f


def _mm(x, w):
    return x @ w.repeat(4, 1)


def scheduled(fn, **compile_kw) -> list[bool]:
    """``reorder_for_peak_memory`` as inductor's scheduler read it for each graph of ``fn``."""
    seen, init = [], Scheduler.__init__

    def spy(self, nodes):
        seen.append(torch._inductor.config.reorder_for_peak_memory)
        init(self, nodes)

    torch._dynamo.reset()
    with mock.patch.object(Scheduler, "__init__", spy), torch._inductor.config.patch(force_disable_caches=True):
        torch.compile(fn, **compile_kw)(torch.ones(2, 8), torch.ones(2, 2))
    return seen


@pytest.mark.slow  # two inductor compiles (18 s): make test-all
def test_reorder_for_peak_memory_is_off_for_the_engines_graphs_only(mesh):
    """Inductor's memory re-sort undoes the reorder pass's prefetches, so the engine's graphs are
    scheduled without it; every other graph in the process as the user set it."""
    cfg = torch._inductor.config
    engine, stranger = _gather_mm(mesh.group_names["intra"]), _gather_mm(dist.new_group([0, 1, 2, 3]).group_name)
    record = passes.install(["reorder"], meshes=[mesh])
    try:
        assert scheduled(_mm) == [True]
        assert scheduled(engine) == [False]
        assert cfg.reorder_for_peak_memory  # back once the compile is over
        assert scheduled(stranger) == [True]  # a collective of a group no installed mesh knows
    finally:
        passes.uninstall()
    assert len(record.records) == 1  # the passes ran on the engine's graph only
    bound = passes.ParoPasses(["reorder"], meshes=[mesh])  # not installed: given to one compile
    with cfg.patch(reorder_for_peak_memory=False):  # what the user set, whichever it is
        assert scheduled(engine, options=bound.inductor_options()) == [False]
        assert cfg.reorder_for_peak_memory is False
    assert cfg.reorder_for_peak_memory
