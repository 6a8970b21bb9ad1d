"""comm.check_collective_order (paro_fsdp/collective_order.py): on 4 gloo ranks as 2x2, a step
whose ranks issue the same collectives passes and logs their count and hash, eager and compiled;
a rank that issues one more collective, or one of another shape, stops every rank at that
collective with one line naming it (before it can hang)."""
from __future__ import annotations

import pytest

from dist_harness import run_world

WORLD = 4


def order_cases(payload: dict) -> dict:
    import torch
    import torch.distributed as dist

    from paro_fsdp import paro_shard
    from paro_fsdp.collective_order import CollectiveOrderCheck, CollectiveOrderError
    from paro_fsdp.train.timeline import group_dims
    from paro_fsdp.mesh import init_paro_mesh
    from workloads import adamw, batch, clip, compile_model, make_model

    rank = dist.get_rank()
    mesh = init_paro_mesh(2)
    out = {}
    check_group = dist.new_group(backend="gloo")
    for name, strategy, plant, compile in payload["cases"]:
        torch._dynamo.reset()
        model = paro_shard(make_model(), mesh, strategy)
        opt = adamw(model)
        call = compile_model(model, {"scope": "blocks"})[0] if compile else model
        if compile:  # the first step compiles; the check runs on the next, as the trainer does
            call(batch(rank, 0, 0)).loss.backward()
            opt.step()
            opt.zero_grad()
        check = CollectiveOrderCheck(
            group_dims(model.paro_mesh_groups(), dist.group.WORLD.group_name), "step 2", group=check_group
        )
        try:
            with check:
                loss = call(batch(rank, 1, 0)).loss
                loss.backward()
                if plant == "extra" and rank == 3:  # one rank reduces something the others do not
                    torch.ops._c10d_functional.all_reduce(
                        torch.ones(3), "sum", model.paro_mesh_groups().group_names["intra"]
                    )
                if plant == "shape" and rank == 2:
                    model._paro_state.comm.all_gather(torch.ones(5), "intra")
                clip(model, 1.0)
                opt.step()
            out[name] = ("ok", check.summary())
        except CollectiveOrderError as exc:
            out[name] = ("error", str(exc))
        dist.barrier()
    return out


CASES = [("eager", "IIG", None, False), ("eager-ggg", "GGG", None, False), ("extra", "IIG", "extra", False),
         ("shape", "NIG", "shape", False), ("compiled", "IIG", None, True)]


@pytest.fixture(scope="module")
def results():
    return run_world(WORLD, "test_collective_order:order_cases", {"cases": CASES})


@pytest.mark.parametrize("name", ["eager", "eager-ggg", "compiled"])
def test_same_collectives_on_every_rank_pass_with_count_and_hash(results, name):
    summaries = {r[name] for r in results}
    assert len(summaries) == 1, summaries  # the same count and hash on every rank
    status, text = summaries.pop()
    assert status == "ok", text
    count = int(text.split()[0])
    assert count > 4 and "identical on every rank (sha256 " in text


def test_compiled_step_is_checked_inside_the_graphs(results):
    """Compiled per block, the blocks' collectives run inside inductor's code; they are seen
    (the count is of the same order as eager, not just the root's few eager collectives)."""
    eager, compiled = (int(results[0][n][1].split()[0]) for n in ("eager", "compiled"))
    assert compiled >= eager // 2, (eager, compiled)


@pytest.mark.parametrize("name, culprit, what", [("extra", 3, "all_reduce over intra of float32[3]"),
                                                 ("shape", 2, "all_gather_into_tensor over intra of float32[5]")])
def test_a_rank_that_differs_stops_every_rank_in_one_line(results, name, culprit, what):
    for rank, r in enumerate(results):
        status, text = r[name]
        assert status == "error", (rank, text)
        assert (
            "\n" not in text and f"rank {culprit} issues {what}" in text and "stopped before it could hang" in text
        ), text
    assert len({r[name] for r in results}) == 1  # the same line everywhere
