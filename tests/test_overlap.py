"""The step boundary under compute (paro_fsdp/overlap.py), on 4 gloo ranks as 2 x 2: the last
micro-step's reductions to the OS level are issued during backward, in the order blocks finish,
and bounded; the push to P is queued at the step (nothing in flight between steps), issued by the
next forward's root and waited at each block's pre-forward, root first, bounded; reads of the
parameters (the optimizer's, at the OS level) never wait for it; a second reducing backward adds
to ``.grad``, as FSDP2's.
Exactness of every strategy on both boundaries is test_paro_shard_strategies.py's grid."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world


def opaque_output_case(strategy: str) -> dict:
    """A model whose output torch's pytree cannot see into (the root gets no pre-backward): the
    same collectives and parameters with and without ``set_is_last_backward``."""
    import types

    import torch
    import torch.nn as nn

    from paro_fsdp import init_paro_mesh, paro_shard

    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x).tanh()
            return types.SimpleNamespace(loss=x.pow(2).mean())

    out = {}
    for last in (False, True):  # False: every backward reduces (FSDP2's default)
        torch.manual_seed(0)
        model = paro_shard(Opaque(), init_paro_mesh(2), strategy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            for a in range(3):
                model.set_requires_gradient_sync(not last or a == 2)
                model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step * 10 + a))).loss.backward()
            opt.step()
            opt.zero_grad()
        stats = model.comm_stats()
        out[last] = {"inter_reductions": stats.count("reduce_scatter", "inter") + stats.count("all_reduce", "inter"),
                     "params": {n: p.full_tensor() for n, p in model.named_parameters()}}
    return out


def working_copy(model) -> "torch.Tensor":
    """layers.0's P-level working copy (the engine's, not a parameter)."""
    import torch

    return torch.cat([t.detach().flatten().clone() for t in model.layers[0]._paro_block.groups[0].p_locals])


def rank_main(payload: dict) -> dict:
    import torch
    import torch.distributed as dist

    from paro_fsdp import init_paro_mesh, paro_shard
    from workloads import batch, make_model

    rank = dist.get_rank()
    out: dict = {}
    for strategy in ("IIG", "NIG", "NII"):
        for limit in (None, 1):
            model = paro_shard(make_model(), init_paro_mesh(2), strategy)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            state, stats = model._paro_state, model._paro_state.comm.stats
            if limit:
                state.boundary.limit_bytes = state.pushes.limit_bytes = limit
            started: list[int] = []  # boundary sequences started, sampled at every block's pre-forward
            order: list[str] = []  # the groups whose boundary started, in order
            queue, fill = state.boundary.queue, state.boundary.fill
            state.boundary.queue = lambda g, s, n: (order.append(g.name), queue(g, s, n))[1]
            state.boundary.fill = lambda **k: (
                fill(**k),
                started.append(sum(e.started for e in state.boundary.entries)),
            )
            case: dict = {}
            for step in range(2):
                for a in range(2):
                    model.set_requires_gradient_sync(a == 1)
                    model(batch(rank, step, a)).loss.backward()
                if step == 0:
                    case["inter_after_backward"] = stats.count("reduce_scatter", "inter") + stats.count(
                        "all_reduce", "inter"
                    )
                    case["max_started"] = max(started)
                    case["grads_after_backward"] = all(
                        p.grad is not None for p in model.parameters() if p.requires_grad
                    )
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
                before = working_copy(model)
                opt.step()
                opt.zero_grad()
                if step == 0:
                    case["pushes_queued"] = len(state.pushes)
                    case["pushes_started"] = sum(e.started for e in state.pushes.entries)
                    case["p_stale"] = torch.equal(working_copy(model), before)
                    seen: list[int] = []
                    in_flight: list[int] = []  # pushes started, at each layer's pre-forward

                    def sample(*_):
                        seen.append(len(state.pushes))
                        in_flight.append(sum(e.started for e in state.pushes.entries))

                    model.set_requires_gradient_sync(False)
                    hooks = [b.register_forward_pre_hook(sample, prepend=True) for b in model.layers]
                    model(batch(rank, 9, 0)).loss.backward()  # an extra micro-step: the pushes land in its forward
                    for h in hooks:
                        h.remove()
                    case["queued_at_layers"] = seen
                    case["started_at_layers"] = in_flight
                    case["p_fresh"] = not torch.equal(working_copy(model), before)
                    for g in state.groups:
                        g.zero_grad()  # drop that micro-step's G-level gradients
            case["order"] = order[:3]
            # the parameters are current right after a step, pushes still in flight or not
            for a in range(2):
                model.set_requires_gradient_sync(a == 1)
                model(batch(rank, 5, a)).loss.backward()
            opt.step()
            case["queued_before_state_dict"] = len(state.pushes)
            wk = model.state_dict()["layers.0.attention.wk.weight"]
            case["state_dict_current"] = wk is not None and torch.equal(
                wk.to_local(), model.layers[0].attention.wk.weight.to_local()
            )
            case["queued_after_state_dict"] = len(state.pushes)
            opt.zero_grad()
            # two reducing backwards add their gradients, as FSDP2's
            model.set_requires_gradient_sync(True)
            grads = []
            for x in (batch(rank, 6, 0), batch(rank, 6, 1)):
                model(x).loss.backward()
                grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.requires_grad})
                opt.zero_grad()
            model(batch(rank, 6, 0)).loss.backward()
            model(batch(rank, 6, 1)).loss.backward()
            case["second_backward_adds"] = all(
                torch.allclose(p.grad.to_local(), grads[0][n] + grads[1][n], rtol=1e-5, atol=1e-7)
                for n, p in model.named_parameters()
                if p.requires_grad
            )
            opt.zero_grad()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                model(batch(rank, 7, 0)).loss.backward()
                opt.step()
                case["queued_while_profiling"] = len(state.pushes)
            out[(strategy, limit)] = case
        out[(strategy, "opaque")] = opaque_output_case(strategy)
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(4, rank_main, {})[0]


@pytest.mark.parametrize("strategy", ["IIG", "NIG", "NII"])
def test_the_boundary_runs_under_the_last_backward(results, strategy):
    case = results[(strategy, None)]
    groups = 3  # root, layers.0, layers.1
    assert case["inter_after_backward"] == groups  # issued in backward, not at clip_grad_norm_
    assert case["order"] == ["layers.1:" + strategy, "layers.0:" + strategy, "<root>:" + strategy]
    assert case["grads_after_backward"]  # landed in .grad by the end of backward, as FSDP2's


@pytest.mark.parametrize("strategy", ["IIG", "NIG", "NII"])
def test_the_push_lands_at_the_next_forward_root_first(results, strategy):
    case = results[(strategy, None)]
    assert case["pushes_queued"] == 3 and case["pushes_started"] == 0 and case["p_stale"]  # none in flight
    assert case["started_at_layers"] == case["queued_at_layers"]  # the root's pre-forward started them all
    # at each layer's pre-forward: the root's push has landed, and with P = I the prefetch of the
    # layer about to run has waited for its push too
    assert case["queued_at_layers"] == ([1, 0] if strategy == "IIG" else [2, 1])
    assert case["p_fresh"]


@pytest.mark.parametrize("strategy", ["IIG", "NIG", "NII"])
def test_reading_the_parameters_does_not_wait_for_the_push(results, strategy):
    case = results[(strategy, None)]
    assert case["queued_before_state_dict"] == 3 and case["queued_after_state_dict"] == 3
    assert case["state_dict_current"]


@pytest.mark.parametrize("strategy", ["IIG", "NIG", "NII"])
def test_bytes_in_flight_are_bounded(results, strategy):
    case = results[(strategy, 1)]
    assert case["max_started"] == 1
    assert case["pushes_queued"] == 3 and case["pushes_started"] == 0
    assert max(case["started_at_layers"]) == 1  # in the forward that lands them, one at a time
    assert case["p_fresh"]


@pytest.mark.parametrize("strategy", ["IIG", "NIG", "NII"])
def test_an_output_pytree_cannot_see_into_changes_nothing(results, strategy):
    """The root gets no pre-backward: the end of backward is still queued (from a block's
    post-backward), so syncing only the last micro-step reduces once per step and group."""
    import torch

    case = results[(strategy, "opaque")]
    assert case[True]["inter_reductions"] == 3 * 2  # 3 groups, 2 steps
    assert case[False]["inter_reductions"] == 3 * 3 * 2  # every backward
    for name, value in case[False]["params"].items():
        torch.testing.assert_close(case[True]["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_no_push_is_left_in_flight_past_a_profiled_step(results):
    """torch.profiler saw it issued; gloo's wait crashed once the profiler had stopped."""
    assert results[("IIG", None)]["queued_while_profiling"] == 0


@pytest.mark.parametrize("strategy", ["IIG", "NIG", "NII"])
def test_a_second_reducing_backward_adds_to_the_gradients(results, strategy):
    assert results[(strategy, None)]["second_backward_adds"]
