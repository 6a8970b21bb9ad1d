"""What a traced step costs the training thread (the numbers: tools/bench/profile_cost.py): the
profiler records no input shapes, which the timeline never reads and which make torch's stop and
export in ``profiler.step()`` 2.6x slower and the trace 1.5x larger; and of a step's micro-steps it
traces only ``profiling.traced_micro_steps`` (the first ones and the last, with the step's
boundary), since the stop and export grow with every micro-step traced."""
from __future__ import annotations

import glob
import json
from collections import Counter
from typing import Any

import pytest
import torch

from dist_harness import run_world


def _profiler(tmp_path, *extra: str):
    from paro_fsdp.train.config_parse import parse_args
    from paro_fsdp.train.metrics import build_profiler

    cfg, _ = parse_args(["--job.dump_folder", str(tmp_path), "--profiling.enable_profiling",
                         "--profiling.profile_freq", "2", *extra], 1)
    seen: list[str] = []
    return build_profiler(cfg, 0, torch.device("cpu"), 0, on_trace=seen.append), seen


def _names(path: str) -> Counter:
    events = json.loads(open(path).read())["traceEvents"]
    return Counter(e["name"] for e in events if e.get("ph") == "X")


def test_traces_carry_no_input_shapes(tmp_path):
    profiler, seen = _profiler(tmp_path)
    with profiler as prof:
        for _ in range(2):
            torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4)).sum()
            prof.step()
    events = json.loads(open(seen[0]).read())["traceEvents"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::linear" for e in ops)
    assert not [e for e in ops if "Input Dims" in e.get("args", {})]


def _steps(prof, grad_accum: int, steps: int) -> None:
    """``steps`` steps of ``grad_accum`` micro-steps, each a named range, then a boundary range."""
    x = torch.ones(2, 2)
    for _ in range(steps):
        for micro in range(grad_accum):
            prof.micro_step(micro, grad_accum)
            with torch.profiler.record_function(f"micro#{micro}"):
                torch.mm(x, x)
        with torch.profiler.record_function("boundary"):
            x.add_(1)
        prof.step()


@pytest.mark.parametrize(
    "traced, kept",
    [(2, [0, 5]), (3, [0, 1, 5]), (1, [5]), (0, list(range(6))), (6, list(range(6))), (9, list(range(6)))],
)
def test_a_traced_step_records_its_first_micro_steps_and_the_last(tmp_path, traced, kept):
    profiler, seen = _profiler(tmp_path, "--profiling.traced_micro_steps", str(traced))
    with profiler as prof:
        _steps(prof, 6, 4)  # steps 1 and 3 are traced (profile_freq 2)
        assert not prof.paused
    assert len(seen) == 2
    for path in seen:
        names = _names(path)
        assert sorted(int(n.split("#")[1]) for n in names if n.startswith("micro#")) == kept
        assert names["boundary"] == 1 and names["aten::mm"] == len(kept)
        assert names["paro::pause#" + str(6 - traced)] == names["paro::resume"] == (1 if 0 < traced < 6 else 0)


# ---- the trainer: a profiled step of 4 micro-steps, 2 of them traced ---------------------------------
ARGS = ["--model.flavor", "debug", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "16", "--training.steps", "2", "--parallelism.paro_strategy", "IIG",
        "--parallelism.paro_group_size", "2", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
        "--comm.backend", "gloo", "--profiling.enable_profiling", "--profiling.profile_freq", "2"]


def world2_traced(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    from paro_fsdp.train.config_parse import parse_args
    from train import Trainer

    out = {}
    for traced in (2, 0):
        cfg, _ = parse_args(ARGS + ["--job.dump_folder", f"{tmp}/traced{traced}", "--profiling.traced_micro_steps",
                                    str(traced)])
        trainer = Trainer(cfg)
        out["grad_accum"] = trainer.grad_accum
        trainer.train()
        trainer.close()
        dist.barrier()
        (out[traced],) = glob.glob(f"{tmp}/traced{traced}/profile_traces/rank{dist.get_rank()}.*.pt.trace.json")
    return out


def _main_thread(path: str) -> list[dict]:
    events = [e for e in json.loads(open(path).read())["traceEvents"] if e.get("ph") == "X"]
    (step,) = [e for e in events if e["name"].startswith("ProfilerStep#")]
    return sorted((e for e in events if e["tid"] == step["tid"]), key=lambda e: e["ts"])


def test_trainer_traces_the_first_and_last_micro_steps_and_the_boundary(tmp_path):
    from paro_fsdp.train import timeline as T

    for result in run_world(2, world2_traced, str(tmp_path)):
        assert result["grad_accum"] == 4
        order = [e["name"] for e in _main_thread(result[2])]
        forward, backward = "aten::embedding", "autograd::engine::evaluate_function: EmbeddingBackward0"
        assert Counter(order)[forward] == Counter(order)[backward] == 2  # of 4 micro-steps, with every one traced:
        assert Counter(e["name"] for e in _main_thread(result[0]))[forward] == 4
        pause, resume = order.index("paro::pause#2"), order.index("paro::resume")
        # micro-step 0 before the pause, micro-step 3 and the boundary (the optimizer step) after the resume
        assert order[:pause].count(forward) == order[:pause].count(backward) == 1
        assert order[resume:].count(forward) == order[resume:].count(backward) == 1
        assert (
            order[resume:].count("Optimizer.step#AdamW.step") == 1 and "Optimizer.step#AdamW.step" not in order[:resume]
        )
        # the timeline leaves the untraced time out: the pause is one cut, the step lasts the traced time
        with open(result[2]) as f:
            trace = json.load(f)
        (step,) = [e for e in trace["traceEvents"] if str(e.get("name")).startswith("ProfilerStep#")]
        tl = T.parse(trace)
        [(at, skipped)] = tl.cuts
        assert skipped == 2 and 0 < at < tl.duration < step["dur"] / 1e3
        assert 0 < T.fractions(tl)["compute_fraction"] <= 1
