"""All 27 strategies on 8 real gloo ranks, as 2 groups of 4 and as 4 groups of 2."""
from __future__ import annotations

import pytest

from dist_harness import run_world
from paro_fsdp import ALL_STRATEGIES
from test_strategies_4ranks import check_against_reference
from workloads import reference

WORLD = 8
CASES = [(s, m, a) for m in (4, 2) for s in ALL_STRATEGIES for a in (1, 3)]


@pytest.fixture(scope="module")
def results():
    return run_world(WORLD, "cases:train_cases", CASES)[0]


@pytest.fixture(scope="module")
def refs():
    return {a: reference(WORLD, a) for a in (1, 3)}


@pytest.mark.parametrize("strategy,group,accum", CASES, ids=[f"{WORLD // m}x{m}-{s}-A{a}" for s, m, a in CASES])
def test_matches_reference(results, refs, strategy, group, accum):
    check_against_reference(results[(strategy, group, accum)], refs[accum])
