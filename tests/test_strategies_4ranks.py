"""All 27 strategies on 4 real gloo ranks (2 groups of 2) against a single-process reference."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world
from paro_fsdp import ALL_STRATEGIES
from workloads import reference

WORLD = 4
CASES = [(s, 2, a) for s in ALL_STRATEGIES for a in (1, 3)]


@pytest.fixture(scope="module")
def results():
    return run_world(WORLD, "cases:train_cases", CASES)


@pytest.fixture(scope="module")
def refs():
    return {a: reference(WORLD, a) for a in (1, 3)}


def check_against_reference(got: dict, ref: dict) -> None:
    for (loss, norm), (ref_loss, ref_norm) in zip(got["losses"], ref["losses"]):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm) + 1e-7, (norm, ref_norm)
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=2e-5, msg=name)


@pytest.mark.parametrize("strategy,group,accum", CASES, ids=[f"{s}-A{a}" for s, _, a in CASES])
def test_matches_reference(results, refs, strategy, group, accum):
    got = results[0][(strategy, group, accum)]
    check_against_reference(got, refs[accum])
    # every rank ends with the same parameters
    for other in results[1:]:
        for name, value in got["params"].items():
            torch.testing.assert_close(other[(strategy, group, accum)]["params"][name], value, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_parameters_are_dtensors_at_p_level(results, strategy):
    expected = {"N": ("Replicate()", "Replicate()"), "I": ("Replicate()", "Shard(dim=0)")}  # repr of placements
    got = results[0][(strategy, 2, 1)]["placements"]
    for name, placement in got.items():
        if strategy[0] == "G":
            assert placement[0].startswith("_StridedShard(dim=0") and placement[1] == "Shard(dim=0)", (name, placement)
        else:
            assert placement == expected[strategy[0]], (name, placement)
