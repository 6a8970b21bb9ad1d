"""The emulator's reduce-scatter (``tools.emulate.gloo_rs``): gloo's result at a ring's bytes.

gloo runs a reduce-scatter as an all-reduce (twice the ring's bytes); the emulator replaces its
CPU kernels with an all-to-all and a local reduction for every system it runs. These check, on 4
gloo ranks, that each way of calling it gives gloo's result, that it sends at most the ring's bytes
(the kernel's loopback counters), and that it survives collectives in flight on the other mesh
dimension."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world


def _lo_tx() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[8])
    raise RuntimeError("no loopback counters")


def calls(payload: dict) -> dict:
    """Every path to a reduce-scatter, under gloo's kernel and then the emulator's: the largest
    difference of results and the loopback bytes of one reduce-scatter under each."""
    import torch.distributed as dist

    from tools.emulate import gloo_rs

    rank, k = dist.get_rank(), dist.get_world_size()
    n = 1 << 20
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    ops = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name

    def each() -> dict[str, torch.Tensor]:
        out = {}
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
            o = torch.empty(n // k)
            dist.reduce_scatter_tensor(o, x, op=op)
            out[f"tensor {op}"] = o
        o = torch.empty(n // k)
        dist.reduce_scatter_tensor(o, x, async_op=True).wait()
        out["async"] = o
        out["functional"] = ops.wait_tensor(ops.reduce_scatter_tensor(x.view(4 * k, -1), "avg", k, name))
        a, b = torch.empty(n // k), torch.empty(n // k // 2)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(a, x)
            dist.reduce_scatter_tensor(b, x[: n // 2])
        cm.wait()
        out["coalesced"] = torch.cat([a, b])
        o = torch.empty(n // k)
        dist.reduce_scatter(o, list(x.chunk(k)))
        out["list"] = o
        return out

    def tx_bytes() -> int:
        dist.barrier()
        before = _lo_tx()
        dist.barrier()  # every rank has read its counter before any sends
        ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", k, name))
        dist.barrier()
        return _lo_tx() - before

    ref, ref_bytes = each(), tx_bytes()
    gloo_rs.install()
    new, new_bytes = each(), tx_bytes()
    return {"diff": {key: float((ref[key] - new[key]).abs().max()) for key in ref},
            "gloo_bytes": ref_bytes, "a2a_bytes": new_bytes, "input_bytes": x.numel() * 4, "k": k}


def test_every_path_gives_gloos_result_at_a_rings_bytes():
    results = run_world(4, "test_gloo_rs:calls", {})
    for r in results:
        assert max(r["diff"].values()) < 1e-5, r["diff"]
        ring = r["k"] * (r["k"] - 1) / r["k"] * r["input_bytes"]  # all ranks' sends on the one loopback
        assert r["gloo_bytes"] > 1.8 * ring  # what the kernel replaces: an all-reduce's bytes
        assert r["a2a_bytes"] < 1.1 * ring


def test_in_flight_with_the_other_dimension():
    """test_gloo_concurrency's stress loop (gathers, reduce-scatters and all-reduces on both
    dimensions of a 2 x 2 mesh, in flight together), the reduce-scatters through the emulator's."""
    results = run_world(4, "test_gloo_concurrency:stress", {"safe": True, "iters": 100, "gloo_rs": True})
    assert results == [100 * 4 * 6] * 4


def test_an_unknown_choice_is_one_line(monkeypatch):
    from tools.emulate import gloo_rs

    monkeypatch.setenv("PARO_EMU_GLOO_RS", "ring")
    with pytest.raises(ValueError, match="expected one of all_to_all, gloo"):
        gloo_rs.install_from_env()
