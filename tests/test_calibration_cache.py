"""The calibration kept between runs (``paro_fsdp/cost/calibration_cache.py``): ``strategy="auto"``
without ``cluster=`` measures a mesh once, then reads it: the same plan run after run.

On 4 real gloo ranks (2 groups x 2), twice in fresh processes, with ``calibrate_in_process`` replaced
by a stand-in that counts its calls and returns timings that move from call to call and rank to rank
(as measured ones do), so a plan read from the cache is told apart from one measured again: the
second ``auto`` on the same mesh and model reads the file and prints the same plan; another torch
version or group size misses; a corrupt file is measured over with one warning; the environment forces
a new measurement. Every cache lives under the test's tmp folder (``PARO_FSDP_CACHE_DIR``). Nothing
asserts on a timing.
"""
from __future__ import annotations

import contextlib
import io
import os
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from dist_harness import run_world

CACHE_ENV, RECALIBRATE_ENV = "PARO_FSDP_CACHE_DIR", "PARO_FSDP_RECALIBRATE"


def _stand_in(calls: list):
    """A collective stand-in for ``calibrate_in_process``: a100_ib with FLOP/s and inter bandwidth that
    differ per call and per rank, so a fresh measurement shows in the plan's table."""
    import torch.distributed as dist

    from paro_fsdp.cost.cluster import load_cluster

    def calibrate_in_process(mesh, model_args=None, micro_batch=1, seq_len=128, dtype="bf16", **kw):
        dist.barrier()  # every rank is in it, as in the real one
        calls.append((micro_batch, seq_len, dtype))
        base, noise = load_cluster("a100_ib"), 1 + 0.13 * len(calls) + 0.07 * dist.get_rank()
        inter = replace(base.inter, bandwidth_gbs=base.inter.bandwidth_gbs / noise, per_kind={})
        return replace(base, name="calibrated", achieved_tflops=base.achieved_tflops * noise, inter=inter,
                       source="tools.calibrate", measured={"ranks": dist.get_world_size(), "device": "cpu"})

    return calibrate_in_process


def _cache_case(payload):
    """On each rank: ``auto`` through ``paro_shard``, ``fully_shard`` and the trainer, step by step;
    per step the stand-in's calls, rank 0's printed plan, the strategies and the warnings."""
    import torch
    import torch.distributed as dist

    import paro_fsdp.cost.calibrate as calibrate
    from paro_fsdp import fully_shard, init_paro_mesh, paro_shard
    from paro_fsdp.api import _default_blocks
    from paro_fsdp.cost.budget import Workload, plan_blocks, spec_of, units_of
    from paro_fsdp.cost.cluster import load_cluster
    from paro_fsdp.models.llama import Llama, flavor
    from paro_fsdp.train.config_parse import parse_args
    from paro_fsdp.train.parallelize import auto_strategy

    os.environ[CACHE_ENV] = payload["cache"]
    os.environ.pop(RECALIBRATE_ENV, None)
    folder = Path(payload["cache"]) / "clusters"
    calls: list = []
    calibrate.calibrate_in_process = _stand_in(calls)
    mesh = init_paro_mesh(2)
    work = Workload(micro_batch=2, seq_len=128, grad_accum=2)
    rank0 = dist.get_rank() == 0

    def llama():
        torch.manual_seed(0)
        return Llama(flavor("debug", max_seq_len=128))

    model = llama()
    single = {s: f for s, f, _ in plan_blocks(units_of(model, _default_blocks(model)), 4, 2, None,
                                              load_cluster("a100_ib"), work, spec_of(model, work), 4, 4, 4).single}
    budget = (single["GGG"] + single["IIG"]) / 2  # between two footprints: a plan the timings decide
    out: dict = {}

    def step(name, shard):
        before, out_text = len(calls), io.StringIO()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out_text):
            warnings.simplefilter("always")
            result = shard()
        strategies = result.paro_strategies() if hasattr(result, "paro_strategies") else result
        out[name] = {"calls": len(calls) - before, "log": out_text.getvalue(), "strategies": strategies,
                     "warnings": [str(w.message) for w in caught if "paro_fsdp" in str(w.message)],
                     "files": sorted(p.name for p in folder.glob("*.toml")) if folder.is_dir() else []}
        dist.barrier()

    def auto(m=None):
        return lambda: paro_shard(llama(), m or mesh, "auto", memory_budget=budget, workload=work)

    def trainer():
        cfg, _ = parse_args(["--parallelism.paro_strategy", "auto", "--training.seq_len", "64",
                             "--training.mixed_precision_param", "float32"], world_size=4)
        lines: list[str] = []
        choice = auto_strategy(cfg, flavor("debug", max_seq_len=64), mesh, 1, torch.device("cpu"), lines.append)
        print("\n".join(lines))
        return {"choice": choice}

    if payload["phase"] == "second":  # a new process: every start reads what the first one kept
        step("auto", auto())
        step("trainer", trainer)
        return out
    step("first", auto())
    step("again", auto())
    step("fully_shard", lambda: fully_shard(llama(), mesh=mesh, strategy="auto", memory_budget=budget,
                                            workload=work))
    step("trainer_first", trainer)
    step("trainer_again", trainer)
    version = torch.__version__
    torch.__version__ = "0.0.1+other"
    try:
        step("other_torch", auto())
    finally:
        torch.__version__ = version
    step("other_group", auto(init_paro_mesh(4)))  # 1 group x 4
    os.environ[RECALIBRATE_ENV] = "1"
    step("forced", auto())
    os.environ[RECALIBRATE_ENV] = "0"
    step("not_forced", auto())
    for kind, damage in (("garbage", lambda text: "[intra\nbandwidth_gbs = ]]\x00"),
                         ("truncated", lambda text: text[: len(text) // 2]),
                         ("other_key", lambda text: text.replace("cache_key = ", "cache_key = \"x\"\nold = "))):
        if rank0:  # the file the first step wrote
            path = folder / out["first"]["files"][0]
            path.write_text(damage(path.read_text()))
        dist.barrier()
        step(f"corrupt_{kind}", auto())
        step(f"after_{kind}", auto())
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("paro_cache"))
    first = run_world(4, "test_calibration_cache:_cache_case", {"cache": cache, "phase": "first"}, timeout=600)
    second = run_world(4, "test_calibration_cache:_cache_case", {"cache": cache, "phase": "second"}, timeout=600)
    return first, second, Path(cache)


def _table(log: str) -> str:
    """The plan as printed, without the line saying where the cluster came from."""
    return "\n".join(line for line in log.splitlines()
                     if "calibrated now" not in line and "calibration cache" not in line)


def test_second_auto_reads_the_cache_and_plans_the_same(worlds):
    first, _, cache = worlds
    for rank, out in enumerate(first):
        assert out["first"]["calls"] == 1 and out["again"]["calls"] == 0, rank
        assert out["again"]["strategies"] == out["first"]["strategies"] == first[0]["first"]["strategies"], rank
    a, b = first[0]["first"], first[0]["again"]
    assert "calibrated now" in a["log"] and "read from the calibration cache" in b["log"]
    (kept,) = a["files"]
    assert str(cache / "clusters" / kept) in a["log"] and str(cache / "clusters" / kept) in b["log"]
    assert _table(b["log"]) == _table(a["log"]) and "paro auto:" in _table(a["log"])
    assert len(set(a["strategies"].values())) > 1, a["log"]  # a plan the timings decide between


def test_fully_shard_auto_reads_the_same_cache(worlds):
    first, _, _ = worlds
    for out in first:
        assert out["fully_shard"]["calls"] == 0
        assert out["fully_shard"]["strategies"] == out["first"]["strategies"]
    assert "read from the calibration cache" in first[0]["fully_shard"]["log"]


def test_trainer_auto_reads_the_cache(worlds):
    first, _, _ = worlds
    for out in first:
        assert out["trainer_first"]["calls"] == 1 and out["trainer_again"]["calls"] == 0
        assert out["trainer_again"]["strategies"] == out["trainer_first"]["strategies"]
    assert "calibrated now" in first[0]["trainer_first"]["log"]
    assert "read from the calibration cache" in first[0]["trainer_again"]["log"]


def test_a_new_process_reads_the_cache(worlds):
    first, second, _ = worlds
    last = "after_other_key"  # the first world's last measurement of this key, kept
    for rank, out in enumerate(second):
        assert out["auto"]["calls"] == 0 and out["trainer"]["calls"] == 0, rank
        assert out["auto"]["strategies"] == first[rank][last]["strategies"]
        assert out["trainer"]["strategies"] == first[rank]["trainer_first"]["strategies"]
    assert "read from the calibration cache" in second[0]["auto"]["log"]
    assert _table(second[0]["auto"]["log"]) == _table(first[0][last]["log"])
    assert _table(second[0]["trainer"]["log"]) == _table(first[0]["trainer_first"]["log"])


def test_another_torch_version_or_group_size_misses(worlds):
    first, _, _ = worlds
    for out in first:
        assert out["other_torch"]["calls"] == 1 and out["other_group"]["calls"] == 1
    files = first[0]
    assert len(files["other_torch"]["files"]) == len(files["trainer_again"]["files"]) + 1
    assert len(files["other_group"]["files"]) == len(files["other_torch"]["files"]) + 1
    assert "calibrated now" in files["other_torch"]["log"] and "calibrated now" in files["other_group"]["log"]


def test_environment_forces_a_new_calibration(worlds):
    first, _, _ = worlds
    for out in first:
        assert out["forced"]["calls"] == 1 and out["not_forced"]["calls"] == 0
    assert "calibrated now" in first[0]["forced"]["log"]
    # the forced measurement replaced the file: what is read next is what it measured
    assert _table(first[0]["not_forced"]["log"]) == _table(first[0]["forced"]["log"])
    assert _table(first[0]["forced"]["log"]) != _table(first[0]["first"]["log"])


@pytest.mark.parametrize("kind", ["garbage", "truncated", "other_key"])
def test_a_corrupt_cache_file_is_measured_over_with_one_warning(worlds, kind):
    first, _, _ = worlds
    for rank, out in enumerate(first):
        assert out[f"corrupt_{kind}"]["calls"] == 1 and out[f"after_{kind}"]["calls"] == 0, rank
        assert out[f"after_{kind}"]["strategies"] == out[f"corrupt_{kind}"]["strategies"]
        assert not out[f"after_{kind}"]["warnings"]
    (line,) = first[0][f"corrupt_{kind}"]["warnings"]
    assert "unreadable" in line and "calibrating again" in line and "\n" not in line
    assert first[0]["first"]["files"][0] in line  # the damaged file, named
    assert "read from the calibration cache" in first[0][f"after_{kind}"]["log"]


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from paro_fsdp.cost.calibration_cache import cache_dir

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine" / "clusters"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "paro_fsdp" / "clusters"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "paro_fsdp" / "clusters"
