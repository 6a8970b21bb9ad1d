"""Options of the gradient reduction and the global collectives, on 4 real gloo ranks (2 groups
of 2): a gradient divide factor (torchtitan sums gradients over ranks: a factor of 1 and the
loss divided by n is the default mean; other factors scale the gradient), and
``flat_below_bytes`` (global collectives below it run as one flat collective over all ranks,
counted as the ledger counts them under the same rule)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_harness import run_world
from workloads import STEPS, close, full_params, reference, sharded, train_steps

WORLD = 4
DIVIDE = ["IIG", "GGG", "NNN"]
FLAT = ["GGG", "NNN", "NNG"]  # global AG and RS each micro-step; the boundary's global AR; global RS and push AG


def divide_by(model, factor: float) -> None:
    """FSDP2's ``set_gradient_divide_factor`` is per module: the whole model is every module's."""
    from paro_fsdp import ParoModule

    for module in model.modules():
        if isinstance(module, ParoModule):
            module.set_gradient_divide_factor(factor)


def rank_main(_: Any = None) -> dict[str, Any]:
    import torch.distributed as dist

    from paro_fsdp import init_paro_mesh
    from paro_fsdp.cost.ledger import buckets_of, traffic_of

    mesh = init_paro_mesh(2)
    world = dist.get_world_size()
    out: dict[str, Any] = {"divide": {}, "flat": {}}

    # the loss divided by the world size and summed over ranks is the default mean
    for s in DIVIDE:
        model, opt = sharded(mesh, s)
        divide_by(model, 1.0)
        out["divide"][s] = {"summed_mean": train_steps(model, opt, STEPS, loss_scale=1.0 / world),
                            "params": full_params(model)}
    model, opt = sharded(mesh, "IIG")
    divide_by(model, 1.0)
    out["divide"]["sum"] = train_steps(model, opt, 1)
    model, opt = sharded(mesh, "IIG")
    divide_by(model, 2.0 * world)
    out["divide"]["half_mean"] = train_steps(model, opt, 1)
    try:
        model.set_gradient_divide_factor(0.0)
    except ValueError as e:
        out["divide"]["error"] = str(e)

    # every global collective below flat_below_bytes runs flat: the same training, counted as
    # the ledger counts it under the same rule
    for s in FLAT:
        model, opt = sharded(mesh, s, flat_below_bytes=1 << 30)
        stats = model.comm_stats()
        stats.reset()
        losses = train_steps(model, opt, STEPS)
        model.wait_for_params()  # the last step's push (else issued by the next forward)
        ledger = traffic_of(buckets_of(model), world, 2, 1, param_bytes=4, grad_bytes=4, flat_below_bytes=1 << 30)
        out["flat"][s] = {"losses": losses, "params": full_params(model), "comm": stats.as_dict(),
                          "ledger": {k: {"count": v["count"] * STEPS, "bytes": v["bytes"] * STEPS}
                                     for k, v in ledger.as_dict().items()}}
    return out


@pytest.fixture(scope="module")
def got():
    return run_world(WORLD, rank_main)[0]


@pytest.mark.parametrize("strategy", FLAT)
def test_flat_global_collectives_train_the_same_and_match_the_ledger(got, strategy):
    """paro_shard(flat_below_bytes=...) above every message: each global collective is one flat
    collective over all ranks (dim "global"), training matches the single-process reference, and
    the engine's counts equal the ledger's under the same rule."""
    r, ref = got["flat"][strategy], reference(WORLD, 1)
    close(r["losses"], ref["losses"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(r["params"][name], value, rtol=0, atol=2e-5, msg=name)
    assert set(r["comm"]) == set(r["ledger"]) and not any(k.endswith("/inter") for k in r["comm"]), r["comm"]
    for key, want in r["ledger"].items():
        assert r["comm"][key]["count"] == want["count"], key
        assert r["comm"][key]["bytes"] == pytest.approx(want["bytes"], rel=0.02), key  # padded buffers


@pytest.mark.parametrize("strategy", DIVIDE)
def test_divide_factor_one_sums_gradients(got, strategy):
    """Loss / n with the sum over ranks = the default mean: same losses, norms and weights."""
    ref = reference(WORLD, 1)
    close(got["divide"][strategy]["summed_mean"], ref["losses"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["divide"][strategy]["params"][name], value, rtol=0, atol=2e-5, msg=name)


def test_divide_factor_scales_the_gradient(got):
    ref = reference(WORLD, 1)["losses"][:1]
    close(got["divide"]["sum"], ref, scale=WORLD)
    close(got["divide"]["half_mean"], ref, scale=0.5)
    assert "must be > 0" in got["divide"]["error"]
