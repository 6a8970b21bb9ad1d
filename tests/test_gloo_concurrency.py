"""Collectives in flight on both mesh dimensions at once, as PaRO-CC and prefetching issue them.

torch 2.13's gloo kernel for the functional all-gather corrupts the heap when it overlaps work
on another process group (see ``paro_fsdp._compat.use_safe_gloo_all_gather``): this loop killed a
rank within a few hundred iterations in 5 of 6 runs before the engine replaced that kernel."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world

pytestmark = pytest.mark.compat

ITERS = 1000


def stress(payload: dict) -> int:
    """Issue all-gathers, reduce-scatters and all-reduces on "intra" and "inter" together, of
    changing sizes, then wait and check every result; return the number of checks."""
    from paro_fsdp._compat import use_safe_gloo_all_gather
    from paro_fsdp.mesh import MeshInfo, init_paro_mesh

    if payload["safe"]:
        use_safe_gloo_all_gather()
    if payload.get("gloo_rs"):  # the emulator's reduce-scatter (tools/emulate/gloo_rs.py)
        from tools.emulate import gloo_rs

        gloo_rs.install()
    info = MeshInfo.from_mesh(init_paro_mesh(2))
    ops = torch.ops._c10d_functional
    checks = 0
    for it in range(payload["iters"]):
        sizes = [2 * int(s) for s in torch.randint(1, 2000, (4,), generator=torch.Generator().manual_seed(it))]
        pending = []
        for s in sizes:
            for dim in ("intra", "inter"):
                name = info.group_names[dim]
                pending.append((ops.all_gather_into_tensor(torch.full((s,), 1.0), 2, name), 2 * s))
                pending.append((ops.reduce_scatter_tensor(torch.ones(s), "sum", 2, name), s))
                pending.append((ops.all_reduce(torch.ones(s), "sum", name), 2 * s))
        for tensor, expected in pending:
            assert float(ops.wait_tensor(tensor).sum()) == expected
            checks += 1
    return checks


@pytest.mark.slow  # 17 s: make test-all
def test_concurrent_collectives_on_both_dimensions():
    results = run_world(4, "test_gloo_concurrency:stress", {"safe": True, "iters": ITERS})
    assert results == [ITERS * 4 * 6] * 4
