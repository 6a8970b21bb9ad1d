"""A refusal is true (``paro_fsdp/cost/peak_search.py``): the smallest footprint ``auto`` names when a
budget is too small is a plan it accepts at that budget, and every budget at or above it gets a plan
within it. The knapsack priced the backward's moments only, so the plan it called the smallest could
peak higher (at the boundary or the push), and budgets above it were refused (a ViT: every budget from
its named smallest up to about 0.9 of its unbudgeted peak). Arithmetic only: no ranks, no timings."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from auto_families import ViT
from paro_fsdp.api import _default_blocks
from paro_fsdp.cost.budget import Block, BudgetError, Unit, Workload, _Env, _items, plan_blocks, units_of
from paro_fsdp.cost.cluster import load_cluster
from paro_fsdp.cost.ledger import peak_of
from paro_fsdp.cost.peak_search import PlanPeaks
from paro_fsdp.cost.workload import seen_workload
from paro_fsdp.overlap import IN_FLIGHT_BYTES
from paro_fsdp.strategy import ALL_STRATEGIES, Strategy

CLUSTER = load_cluster("a100_ib")


def _model(rng: random.Random, layers: int) -> list[Block]:
    """A root of any size and ``layers`` blocks of one size (a few with a frozen part, as LoRA's base)."""
    size = rng.randint(1_000, 200_000)
    out = [Block("<root>", (Unit(("root.w",), rng.randint(1, 400_000), True),), True)]
    for i in range(layers):
        units = [Unit((f"l.{i}.w",), size, True)]
        if rng.random() < 0.3:
            units.append(Unit((f"l.{i}.frozen",), rng.randint(1_000, 100_000), False))
        out.append(Block(f"l.{i}", tuple(units), False, f"l.{i}"))
    return out


def _workload(rng: random.Random) -> Workload:
    acts = rng.uniform(0, 3e6)
    return Workload(2, 64, 2, rng.random() < 0.25, activation_bytes=acts,
                    activations_in_backward=acts * rng.uniform(0.5, 1.0),
                    activations_after_backward=acts * rng.uniform(0.1, 0.5))


def _plan(blocks, work, budget):
    return plan_blocks(blocks, 4, 2, budget, CLUSTER, work, None, 4, 4, 4)


def _smallest(blocks, work) -> float:
    with pytest.raises(BudgetError) as info:
        _plan(blocks, work, 1.0)
    assert "\n" not in str(info.value) and info.value.smallest is not None
    return info.value.smallest


@pytest.mark.parametrize("seed", range(8))
def test_a_budget_is_accepted_iff_it_is_at_least_the_smallest_footprint_named(seed):
    """Random roots, blocks, frozen parts, activations and checkpointing: the refusal's smallest footprint
    is accepted, with a plan within it; budgets above it too; budgets under it refused with the same one."""
    rng = random.Random(seed)
    blocks, work = _model(rng, rng.randint(1, 5)), _workload(rng)
    small = _smallest(blocks, work)
    for budget in [small, small * 1.0001, *(small * rng.uniform(1.0, 1.6) for _ in range(3))]:
        plan = _plan(blocks, work, budget)
        assert plan.footprint <= budget + 1e-6, (budget, plan.footprint)
    for budget in (small * rng.uniform(0.5, 0.999) for _ in range(2)):
        with pytest.raises(BudgetError) as info:
            _plan(blocks, work, budget)
        assert info.value.smallest == small


@pytest.mark.parametrize("seed", range(8))
def test_the_smallest_footprint_is_the_brute_force_minimum(seed):
    """A root and two blocks over ten strategies (each block's frozen part at three P levels): the smallest
    whole peak found is the least of every plan's ``ledger.peak_of``, and its plan has it."""
    rng = random.Random(1000 + seed)
    blocks, work = _model(rng, 2), _workload(rng)
    strategies = [Strategy.parse(s) for s in rng.sample(ALL_STRATEGIES, 10)]
    env = _Env(4, 2, CLUSTER, work, None, 4, 4, 4, True, 0)
    items = _items(env, blocks, strategies, False)
    args = (work.activation_bytes, work.activation_checkpoint, float(IN_FLIGHT_BYTES), work.activations_in_backward,
            work.activations_after_backward)
    small, plan = PlanPeaks(items, *args).smallest()

    def peak(idx):
        return peak_of([items[k][i].detail for k, i in enumerate(idx)], *args)["peak"]

    best = min(peak(idx) for idx in itertools.product(*[range(len(opts)) for opts in items]))
    assert small == pytest.approx(best, rel=1e-9) and peak(plan) == pytest.approx(small, rel=1e-9)


def test_every_budget_from_a_vits_smallest_footprint_up_gets_a_plan():
    """The issue's shape: 2 images of 32 x 32, measured from the batch. Every budget on a grid from the
    named smallest footprint to the unbudgeted plan's peak gets a plan within it, some of them a plan per
    block (11 of these 20 budgets were refused, the per-block plan never reached)."""
    torch.manual_seed(0)
    model = ViT(dim=64, depth=4, patch=8, image=32, classes=10, mlp=4, heads=8)  # the shape
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    loss = lambda logits: nn.functional.cross_entropy(logits, y)  # noqa: E731
    blocks = _default_blocks(model)
    work, _ = seen_workload(model, Workload(example_inputs=x, grad_accum=2, loss_fn=loss), None, torch.float32,
                            True, blocks)
    units = units_of(model, blocks)
    small, free = _smallest(units, work), _plan(units, work, None).footprint
    plans = [_plan(units, work, small + (free - small) * i / 19) for i in range(20)]
    assert all(p.footprint <= p.budget + 1e-6 for p in plans)
    assert any(p.header.startswith("paro auto: a strategy per block") for p in plans)
