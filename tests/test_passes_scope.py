"""What the graph passes count as compute, and which graphs their inductor settings reach.

Graphs are built by hand (the passes read only targets, users and metadata) or traced on CPU, so
each case takes well under a second; no process group is needed.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

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
