"""CUDA only (``python -m tools.gpu_check`` runs these as its part (e)): torch's CUDA sanitizer over
one strategy of each level, the synchronising calls of a training step, and the caching
allocator's reserved bytes beside its allocated ones, in the four stand-in ranks of
``test_gpu_streams.py``.

* ``TORCH_CUDA_SANITIZER=1`` (``torch.cuda._sanitizer``) records, for every kernel torch
  dispatches, which tensors it reads and writes on which stream, and raises at the first access
  from one stream to a tensor last touched on another without an ordering between them. It is
  per process, so each spawned rank runs it (the variable set before the rank imports torch),
  eagerly (it cannot see inside compiled kernels). To it a collective is one kernel on the stream
  that issued it, so it checks the engine's side of the protocol: side stream after compute
  stream at the issue, consumer after the side stream's event. Self-test: a planted missing wait
  must make it report a race.
* ``torch.cuda.set_sync_debug_mode("warn")`` from the second step on: the only synchronising call
  expected is the trainer's non-finite guard (``NonFiniteGuard.allows_step``, one device-to-host
  read per step), used as ``train.py`` uses it. The stand-in's own host phase is exempt.
* ``max_memory_reserved()`` beside ``max_memory_allocated()`` per run.

The plumbing runs on CPU with CUDA faked: ``tests/test_gpu_check_streams.py``.
"""
from __future__ import annotations

import pytest
import torch

import stream_workload as sw

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the sanitizer, the sync debug "
                                 "mode and the caching allocator are CUDA's"), pytest.mark.timeout(900)]
STRATEGIES = ("NNN", "IIG", "GGG")  # one per level
SANITIZED = "stream_workload:rank_sanitized"
ENV = {"TORCH_CUDA_SANITIZER": "1"}  # read by each spawned rank's import of torch


@pytest.fixture(scope="module")
def runs():
    return sw.run_cases("cuda", [{"id": s, "strategy": s} for s in STRATEGIES], target=SANITIZED, env=ENV)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_sanitizer_reports_no_race(runs, strategy, record_property):
    got = sw.compare(sw.reference("cuda"), runs[strategy], sw.TOL["cuda"])
    record_property("measured", f"param diff {got['param_diff']:.1e}")
    assert all(r["sanitizer"] for r in runs[strategy].values()), "the sanitizer is off in a rank"
    assert got["ok"], got


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_only_the_non_finite_guard_synchronises(runs, strategy):
    for rank, r in runs[strategy].items():
        got = sw.classify_syncs([tuple(s) for s in r["syncs"]])
        assert got["unexpected"] == 0 and got["expected"] == sw.STEPS - sw.SYNC_FROM_STEP, (rank, got)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reserved_memory_beside_allocated(runs, strategy, record_property):
    r = runs[strategy][0]
    record_property("measured", f"allocated {r['allocated'] / 2**20:.1f} MiB, reserved {r['reserved'] / 2**20:.1f} MiB")
    assert 0 < r["allocated"] <= r["reserved"]


def test_bf16_masters_sent_cast_on_the_gather_stream_race_free():
    """GGG in bf16 casts the fp32 masters on the gather stream for each gather (no bf16 copy
    kept): no race, and the same training as IGG's pushed copy, bit for bit."""
    runs = sw.run_cases("cuda", list(sw.BF16_PAIR), target=SANITIZED, env=ENV)
    assert sw.same_training(runs["GGG+bf16"], runs["IGG+bf16"]) == []


def test_the_sanitizer_reports_a_planted_missing_wait():
    with pytest.raises(RuntimeError, match="CUDASanitizerErrors"):
        sw.run_cases("cuda", [{"id": "IIG+missing-wait", "strategy": "IIG", "plant": "missing-wait"}], target=SANITIZED,
                     env=ENV)
