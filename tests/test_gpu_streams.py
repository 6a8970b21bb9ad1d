"""The engine's stream protocol on four ranks sharing one device as a 2 x 2 mesh over gloo (NCCL
refuses two ranks on one GPU). Every ``_c10d_functional`` collective goes through the stand-in
kernels (``tests/harness/standin.py``: the output poisoned until ``wait()``, then the exact gloo
result; on CUDA written in NCCL's stream order behind a sleep) and the model stalls the compute
stream, so a missing wait, or a side stream that does not wait for the compute stream, changes
the numbers. Every strategy, and one compiled block, must match one process; the planted bugs
(``stream_workload.planted``) must fail.

On CUDA these run on the one GPU (skipped without one; ``python -m tools.gpu_check`` runs them
as its part (d)); on CPU the same tests run in the stand-in's CPU mode, where the deferred
completion alone decides (a consumer that skips ``wait()`` reads NaN): ``make test-all``.
``PARO_STREAMS_DEVICE=cpu|cuda`` keeps one of the two (the GPU check's ``--device``).
"""
from __future__ import annotations

import os

import pytest
import torch

import stream_workload as sw
from paro_fsdp import ALL_STRATEGIES

DEVICES = [pytest.param("cpu", marks=pytest.mark.slow),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
if os.environ.get("PARO_STREAMS_DEVICE"):
    DEVICES = [p for p in DEVICES if p.values[0] == os.environ["PARO_STREAMS_DEVICE"]]
CORE = ("NNN", "III", "IIG", "GGG", "NIG", "ING")  # one per level and the mixed ones: reported first
STRATEGIES = list(CORE) + [str(s) for s in ALL_STRATEGIES if str(s) not in CORE]
COMPILED = "GGG"
PLANTED = ("NNN", "IIG", "GGG")  # one strategy per level; each planted run must fail
# one world runs every case of a device; the first test that asks for it waits for all of them
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(device):
    return sw.reference(device)


@pytest.fixture(scope="module")
def runs(device):
    cases = [{"id": s, "strategy": s} for s in STRATEGIES] + [
        {"id": "compiled", "strategy": COMPILED, "compiled": True}
    ]
    return sw.run_cases(device, cases)


@pytest.fixture(scope="module")
def planted_runs(device):
    plants = [p for p in sw.PLANTS if device == "cuda" or p not in sw.CUDA_ONLY]
    return sw.run_cases(device, [{"id": f"{s}+{p}", "strategy": s, "plant": p} for p in plants for s in PLANTED])


def _why(c: dict) -> str:
    if not c["finite"]:
        return "non-finite (NaN reached the loss or the parameters)"
    return f"loss rel {c['loss_rel']:.1e}, norm rel {c['norm_rel']:.1e}, param diff {c['param_diff']:.1e}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_matches_one_process(device, reference, runs, strategy, record_property):
    """3 steps of A = 2 with clipping, every rank against one process; every collective went
    through the stand-in and was waited for."""
    got = sw.compare(reference, runs[strategy], sw.TOL[device])
    record_property("measured", _why(got))
    assert got["ok"], _why(got)
    served = runs[strategy][0]["standin"]
    assert served["works"] > 0 and served["never_waited"] == 0, served


def test_compiled_block_holds_the_collectives_and_matches(device, reference, runs, record_property):
    """``layers.0`` compiled as the trainer compiles blocks (the graph passes; inductor on CUDA,
    their AOT backend on CPU): its graphs hold the block's gathers and reductions, and backward
    re-gathers (reshard_after_forward), and the run still matches one process."""
    graphs = runs["compiled"][0]["graph_collectives"]
    got = sw.compare(reference, runs["compiled"], sw.TOL[device])
    record_property("measured", ", ".join(f"{k} {v}" for k, v in sorted(graphs.items())) + "; " + _why(got))
    assert got["ok"], _why(got)
    assert graphs.get("forward all_gather/intra", 0) > 0 and graphs.get("backward reduce_scatter/inter", 0) > 0, graphs
    assert graphs.get("backward all_gather/intra", 0) > 0 and graphs.get("backward all_gather/inter", 0) > 0, graphs


@pytest.mark.parametrize("plant", sw.PLANTS)
@pytest.mark.parametrize("strategy", PLANTED)
def test_a_planted_bug_fails(device, reference, planted_runs, plant, strategy, record_property):
    """The self-test: with a wait left out (missing-wait) or a side stream that does not wait for
    the compute stream (issue-wait, CUDA only), the run no longer matches."""
    if plant in sw.CUDA_ONLY and device != "cuda":
        pytest.skip("CPU has no streams: the side stream's wait for the compute stream exists on CUDA only")
    case = planted_runs[f"{strategy}+{plant}"]
    got = sw.compare(reference, case, sw.TOL[device])
    record_property("measured", _why(got))
    assert not got["ok"]
    if device == "cpu":  # on CPU the consumer read the poison itself, and never waited for it
        assert not got["finite"] and case[0]["standin"]["never_waited"] > 0
