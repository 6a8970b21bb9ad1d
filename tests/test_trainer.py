"""The trainer end to end on real gloo ranks: every main strategy family, activation
checkpointing, TensorBoard/profiler/metrics output, exact resume, and checkpoints that load
under another strategy and world size (IIG on 4 ranks -> GGG on 2 ranks -> IIG on 4 ranks).

Building a trainer costs a second or more per run, so three worlds are started for the module
(4 ranks, then 2, then 4 again) and every case runs inside them.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dist_harness import run_world  # noqa: E402

FAMILIES = ("NNN", "IIG", "GGG")
MORE_FAMILIES = ("NIG", "ING")  # the slow set (test_more_families_train_and_agree)
# the debug flavor, small windows, 2 micro-steps per optimizer step on 4 ranks (1 on 2 ranks x 2)
BASE = ["--model.flavor", "debug", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "16", "--training.mixed_precision_param", "float32",
        "--training.mixed_precision_reduce", "float32", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.decay_type", "cosine", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "false", "--comm.backend", "gloo"]


# ---- run inside the ranks -----------------------------------------------------------------------
def _trainer(argv: list[str]):
    from paro_fsdp.train.config_parse import parse_args
    from train import Trainer

    cfg, _ = parse_args(BASE + argv)
    return Trainer(cfg)


def _run(argv: list[str]) -> tuple[Any, dict[int, float]]:
    trainer = _trainer(argv)
    losses = trainer.train()
    trainer.close()
    return trainer, losses


def _full_state(trainer) -> dict[str, Any]:
    """Full fp32 master weights (the parameters) and Adam moments (gathered from whatever layout,
    keyed by parameter name through DCP's get_state_dict), and whether every module parameter is
    back to its sharded DTensor."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    master = {k: v.full_tensor().clone() for k, v in model_sd.items() if isinstance(v, DTensor)}
    moments = {k: {n: t.full_tensor().clone() for n, t in v.items() if isinstance(t, DTensor)}
               for k, v in optim_sd["state"].items()}
    sharded = all(isinstance(p, DTensor) for p in trainer.model.parameters())
    return {"master": master, "moments": moments, "sharded": sharded, "step": trainer.state.step}


def _count_inter_before_clip(trainer) -> list[tuple[int, int]]:
    """Per step, the inter-group reductions issued before ``clip_grad_norm_`` (since the last
    ``zero_grad``) and from there to this step's ``zero_grad``: all of them come first when the
    boundary runs under the last backward."""
    stats = trainer.model.comm_stats
    counts: list[tuple[int, int]] = []
    marks = [0, 0]

    def inter() -> int:
        s = stats()
        return int(s.count("reduce_scatter", "inter") + s.count("all_reduce", "inter"))

    clip, zero = trainer.clip_grad_norm_, trainer.optimizer.zero_grad

    def clip_counted(*a, **k):
        marks[1] = inter()
        return clip(*a, **k)

    def zero_counted(*a, **k):
        zero(*a, **k)
        now = inter()
        counts.append((marks[1] - marks[0], now - marks[1]))
        marks[0] = now

    trainer.clip_grad_norm_, trainer.optimizer.zero_grad = clip_counted, zero_counted
    return counts


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def world4_first(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    out: dict[str, Any] = {}
    # one short run per strategy family (2 groups of 2)
    for s in FAMILIES:
        extra = []
        if s == "IIG":  # this one also writes TensorBoard scalars, metrics.jsonl and profiler traces
            extra = ["--metrics.enable_tensorboard", "--profiling.enable_profiling", "--profiling.profile_freq", "2",
                     "--job.dump_folder", f"{tmp}/iig"]
        trainer = _trainer(["--parallelism.paro_strategy", s, "--parallelism.paro_group_size", "2",
                            "--training.steps", "3"] + extra)
        inter_before_clip = _count_inter_before_clip(trainer)
        losses = trainer.train()
        trainer.model.wait_for_params()  # the last step's push (else issued by a next forward)
        trainer.close()
        out[f"family/{s}"] = {"losses": losses, "comm": trainer.model.comm_stats().as_dict(),
                              "memory": trainer.model.memory_report(trainer.optimizer),
                              "inter_before_clip": inter_before_clip}
    # GGG with the quantized wire between groups ([parallelism] inter_dtype)
    from paro_fsdp.train.metrics import startup_lines

    trainer, losses = _run(["--parallelism.paro_strategy", "GGG", "--parallelism.paro_group_size", "2",
                            "--parallelism.inter_dtype", "int8", "--training.steps", "3"])
    out["int8/GGG"] = {"losses": losses, "comm": trainer.model.comm_stats().as_dict(),
                       "start": startup_lines(trainer)}
    # compiled with the trainer's defaults (per block, the push eager; AOTAutograd graphs run as
    # they are: inductor codegen costs minutes on 2 cores); its step 2 is traced too (the timeline
    # of collectives that run inside graphs)
    # (and comm.check_collective_order: step 2, the first after compiling, compared across ranks)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        trainer, losses = _run(
            [
                "--parallelism.paro_strategy",
                "IIG",
                "--parallelism.paro_group_size",
                "2",
                "--training.steps",
                "3",
                "--compile.enable",
                "--compile.backend",
                "aot_eager",
                "--metrics.enable_tensorboard",
                "--profiling.enable_profiling",
                "--profiling.profile_freq",
                "2",
                "--job.dump_folder",
                f"{tmp}/compiled",
                "--comm.check_collective_order",
                "true",
            ]
        )
    out["compiled/IIG"] = {"losses": losses, "comm": trainer.model.comm_stats().as_dict(),
                           "order": [x for x in log.getvalue().splitlines() if "collective order" in x]}
    # a per-tensor policy and bf16 parameters
    _, losses = _run(
        [
            "--parallelism.paro_strategy",
            "IIG",
            "--parallelism.paro_group_size",
            "2",
            "--training.steps",
            "3",
            "--parallelism.paro_policy",
            "tok_embeddings.*=NIG,output.*=GGG",
            "--training.mixed_precision_param",
            "bfloat16",
        ]
    )
    out["policy_bf16"] = losses
    # full activation checkpointing (exact against no checkpointing)
    for name, argv in {
        "ac/IIG": ["--parallelism.paro_strategy", "IIG"],  # re-sharded after forward, re-gathered for the recompute
        "ac/NNG": ["--parallelism.paro_strategy", "NNG"],
    }.items():
        trainer, losses = _run(argv + ["--parallelism.paro_group_size", "2", "--training.steps", "3",
                                       "--activation_checkpoint.mode", "full"])
        out[name] = {"losses": losses, "sharded": _full_state(trainer)["sharded"]}

    # resume: 6 steps saving every step (keep 4), then a run that resumes from step 3
    ck = ["--parallelism.paro_strategy", "IIG", "--parallelism.paro_group_size", "2", "--training.steps", "6",
          "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "4",
          "--job.dump_folder", f"{tmp}/resume"]
    _, out["resume/full"] = _run(ck)
    out["resume/kept"] = sorted(os.listdir(f"{tmp}/resume/checkpoint"))
    if rank0:  # debris of a crash mid-save and a folder without DCP metadata: never loaded
        os.makedirs(f"{tmp}/resume/checkpoint/step-9.tmp")
        os.makedirs(f"{tmp}/resume/checkpoint/step-12")
    _barrier()
    trainer, losses = _run(ck)  # latest complete checkpoint is step 6: nothing left to train
    out["resume/latest"] = (trainer.resumed_from, losses, sorted(os.listdir(f"{tmp}/resume/checkpoint")))
    trainer, losses = _run(ck + ["--checkpoint.load_step", "3"])
    out["resume/from3"] = (trainer.resumed_from, losses)

    # cross-strategy source: IIG on 4 ranks, 3 steps, checkpoint at step 3
    trainer, _ = _run(
        [
            "--parallelism.paro_strategy",
            "IIG",
            "--parallelism.paro_group_size",
            "2",
            "--training.steps",
            "3",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "3",
            "--job.dump_folder",
            f"{tmp}/cross",
        ]
    )
    out["cross/iig4"] = _full_state(trainer)
    return out


def world4_more_families(tmp: str) -> dict[str, Any]:
    out = {}
    for s in MORE_FAMILIES:
        _, losses = _run(["--parallelism.paro_strategy", s, "--parallelism.paro_group_size", "2",
                          "--training.steps", "3", "--job.dump_folder", f"{tmp}/{s}"])
        out[s] = losses
    # the whole model in one graph and the push graph (68 s of aot_eager tracing here)
    trainer, losses = _run(["--parallelism.paro_strategy", "IIG", "--parallelism.paro_group_size", "2",
                            "--training.steps", "3", "--compile.enable", "--compile.backend", "aot_eager",
                            "--compile.scope", "model", "--compile.push_graph", "--job.dump_folder", f"{tmp}/compiled"])
    out["compiled/IIG/model"] = {"losses": losses, "comm": trainer.model.comm_stats().as_dict()}
    return out


def world2(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cross = ["--parallelism.paro_strategy", "GGG", "--parallelism.paro_group_size", "1", "--checkpoint.enable",
             "--checkpoint.interval", "5", "--job.dump_folder", f"{tmp}/cross"]
    trainer, losses = _run(cross + ["--training.steps", "3"])  # loads IIG/4's step 3, nothing to train
    out["cross/ggg2_loaded"] = {**_full_state(trainer), "resumed_from": trainer.resumed_from, "losses": losses}
    trainer, losses = _run(cross + ["--training.steps", "5"])  # two more steps under GGG/2, saved at 5
    out["cross/ggg2_trained"] = {**_full_state(trainer), "losses": losses}
    return out


def world4_second(tmp: str) -> dict[str, Any]:
    trainer, losses = _run(
        [
            "--parallelism.paro_strategy",
            "IIG",
            "--parallelism.paro_group_size",
            "2",
            "--training.steps",
            "5",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "5",
            "--job.dump_folder",
            f"{tmp}/cross",
        ]
    )
    return {"cross/iig4_loaded": {**_full_state(trainer), "resumed_from": trainer.resumed_from, "losses": losses}}


# ---- the three worlds, once per module ----------------------------------------------------------
@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="module")
def first(tmp) -> dict[str, Any]:
    return run_world(4, "test_trainer:world4_first", tmp)[0]


@pytest.fixture(scope="module")
def second(first, tmp) -> dict[str, Any]:
    return run_world(2, "test_trainer:world2", tmp)[0]


@pytest.fixture(scope="module")
def third(second, tmp) -> dict[str, Any]:
    return run_world(4, "test_trainer:world4_second", tmp)[0]


# ---- checks -----------------------------------------------------------------------------------
@pytest.mark.compat
def test_every_family_trains_and_agrees(first):
    ref = first["family/NNN"]["losses"]
    assert sorted(ref) == [1, 2, 3] and all(math.isfinite(v) for v in ref.values())
    assert ref[1] == pytest.approx(math.log(258), abs=0.3)  # starts near uniform over the vocabulary
    for s in FAMILIES:
        losses = first[f"family/{s}"]["losses"]
        for step in ref:  # the same math in every layout (fp32; only the summation order differs)
            assert losses[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-5), (s, step)
    assert first["family/NNN"]["losses"][3] < first["family/NNN"]["losses"][1]


def test_inter_dtype_quantizes_what_crosses_groups(first):
    """``--parallelism.inter_dtype int8``: GGG's inter bytes 3.9x fewer, the intra ones alike, the loss within
    the wire's error of the exact run's, and the start-up line says so."""
    exact, q = first["family/GGG"], first["int8/GGG"]

    def sent(run, dim):
        return sum(v["bytes"] for k, v in run["comm"].items() if k.endswith(dim))

    assert sent(exact, "/inter") / sent(q, "/inter") > 3.5
    assert sent(q, "/intra") == sent(exact, "/intra")
    for step, loss in exact["losses"].items():
        assert q["losses"][step] == pytest.approx(loss, rel=2e-3), step
    assert any("between groups int8" in line for line in q["start"]), q["start"]


@pytest.fixture(scope="module")
def more(tmp_path_factory) -> dict[str, Any]:
    return run_world(4, "test_trainer:world4_more_families", str(tmp_path_factory.mktemp("more")))[0]


@pytest.mark.slow
def test_more_families_train_and_agree(first, more):
    ref = first["family/NNN"]["losses"]
    for s in MORE_FAMILIES:
        for step in ref:
            assert more[s][step] == pytest.approx(ref[step], rel=1e-5, abs=1e-5), (s, step)


def test_family_comm_and_memory_follow_the_strategy(first):
    def inter(s):
        return sum(v["bytes"] for k, v in first[f"family/{s}"]["comm"].items() if k.endswith("/inter"))

    nnn, iig, ggg = (first[f"family/{s}"]["memory"]["total"] for s in ("NNN", "IIG", "GGG"))
    assert ggg < iig < nnn
    assert 0 < inter("IIG") < inter("GGG")  # IIG crosses groups once per step, GGG every micro-step
    # eager, the trainer marks the last micro-step: IIG's boundary reductions run under its backward
    counts = first["family/IIG"]["inter_before_clip"]
    assert len(counts) == 3 and all(before > 0 and after == 0 for before, after in counts), counts


def _eager_bytes(run: dict, key: str) -> float:
    return run["comm"].get(key, {}).get("bytes", 0.0)


@pytest.mark.compat
def test_compiled_trainer_matches_eager_with_the_boundary_in_graphs(first):
    got, want = first["compiled/IIG"], first["family/IIG"]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    # comm.check_collective_order compared the first compiled step's collectives (rank 0 logs it)
    assert len(got["order"]) == 1 and "in step 2 identical on every rank" in got["order"][0], got["order"]
    # eager IIG crosses groups at the boundary (inter RS, then the push's inter AG). Compiled per
    # block, the blocks' boundary reductions are graph nodes (only the root's runs eagerly) and
    # the push stays eager (compile.push_graph off): the same AG bytes, fewer eager RS bytes.
    assert 0 < _eager_bytes(got, "reduce_scatter/inter") < _eager_bytes(want, "reduce_scatter/inter")
    assert _eager_bytes(got, "all_gather/inter") == _eager_bytes(want, "all_gather/inter") > 0
    assert _eager_bytes(got, "reduce_scatter/intra") < _eager_bytes(want, "reduce_scatter/intra")


@pytest.mark.slow
def test_compiled_whole_model_and_push_graph_run_nothing_across_groups_eagerly(first, more):
    got, want = more["compiled/IIG/model"], first["family/IIG"]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    # the whole model's boundary and the push are graph nodes (set_requires_gradient_sync on the
    # last micro-step, traced._compile_push), so no inter traffic runs eagerly
    assert any(k.endswith("/inter") for k in want["comm"])
    assert not any(k.endswith("/inter") and v["bytes"] for k, v in got["comm"].items())


def test_policy_and_bf16(first):
    losses = first["policy_bf16"]
    ref = first["family/IIG"]["losses"]
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[3] == pytest.approx(ref[3], rel=0.05)


def test_activation_checkpointing_is_exact(first):
    for name, ref in (("ac/IIG", "family/IIG"), ("ac/NNG", "family/NNN")):
        got, want = first[name]["losses"], first[ref]["losses"]
        assert got == pytest.approx(want, rel=1e-5), name
        assert first[name]["sharded"], f"{name}: a module kept a gathered parameter after training"


def test_outputs_tensorboard_metrics_traces(first, tmp):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(tmp) / "iig"
    runs = list((root / "tb").iterdir())
    assert len(runs) == 1
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss/train", "optim/grad_norm", "optim/lr", "throughput/tokens_per_s", "time/step_s",
                "memory/model_states_MiB", "memory/peak_rss_MiB", "comm/intra_MiB_per_step", "comm/inter_MiB_per_step"):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("loss/train")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("loss/train")] == pytest.approx(list(first["family/IIG"]["losses"].values()))
    lines = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and lines[0]["comm/inter_MiB_per_step"] > 0
    traces = sorted(p.name for p in (root / "profile_traces").iterdir())
    assert {t.split(".")[0] for t in traces} == {"rank0", "rank1", "rank2", "rank3"}
    assert all(t.endswith(".pt.trace.json") for t in traces)


@pytest.mark.parametrize("run", ["iig", "compiled"])
def test_timeline_images_in_tensorboard(first, tmp, run):
    """Each rank's run <run>/timeline_rank<r> holds the traced step's timeline image (with intra and
    inter rows drawn: IIG on 2 x 2 gathers within groups and crosses them at the boundary, eagerly
    or inside the compiled graphs) and its fractions as scalars."""
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from paro_fsdp.train.timeline import COLORS

    (tb,) = (Path(tmp) / run / "tb").iterdir()
    assert sorted(p.name for p in tb.iterdir() if p.is_dir()) == [f"timeline_rank{r}" for r in range(4)]
    for r in range(4):
        acc = EventAccumulator(str(tb / f"timeline_rank{r}"), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        assert acc.Tags()["images"] == [f"timeline/rank{r}"]
        (image,) = acc.Images(f"timeline/rank{r}")
        assert image.step == 2  # profile_freq 2: the second step is traced
        pixels = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB")).astype(int)
        for row in ("compute", "intra", "inter"):
            rgb = np.array([int(COLORS[row][i:i + 2], 16) for i in (1, 3, 5)])
            assert (np.abs(pixels - rgb).sum(axis=-1) < 10).any(), (run, r, row)
        values = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
        for tag in ("overlap_fraction", "inter_busy_fraction", "intra_busy_fraction", "compute_fraction"):
            assert len(values[f"timeline/{tag}"]) == 1 and 0 <= values[f"timeline/{tag}"][0] <= 1, (run, r, tag)
        assert values["timeline/inter_busy_fraction"][0] > 0 and values["timeline/intra_busy_fraction"][0] > 0


def test_checkpoints_pruned_and_incomplete_ones_ignored(first):
    assert first["resume/kept"] == ["step-3", "step-4", "step-5", "step-6"]
    resumed_from, losses, left = first["resume/latest"]
    assert resumed_from == 6 and losses == {}
    assert "step-9.tmp" not in left and "step-12" not in left  # crash debris removed; the metadata-less folder
    assert "step-12.damaged" in left  # is moved aside (named in the log), never loaded nor overwritten


@pytest.mark.compat
def test_resume_reproduces_the_loss_curve_exactly(first):
    full = first["resume/full"]
    resumed_from, resumed = first["resume/from3"]
    assert resumed_from == 3 and sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]  # bit-identical (fp32, CPU)


def _assert_same_state(a: dict, b: dict) -> None:
    import torch

    assert a["master"].keys() == b["master"].keys()
    for k in a["master"]:
        torch.testing.assert_close(a["master"][k], b["master"][k], rtol=0, atol=0, msg=k)
        for n in a["moments"][k]:
            torch.testing.assert_close(a["moments"][k][n], b["moments"][k][n], rtol=0, atol=0, msg=f"{k}.{n}")


def test_checkpoint_iig4_loads_as_ggg2(first, second):
    loaded = second["cross/ggg2_loaded"]
    assert loaded["resumed_from"] == 3 and loaded["losses"] == {} and loaded["sharded"]
    _assert_same_state(first["cross/iig4"], loaded)


def test_checkpoint_ggg2_loads_back_as_iig4(second, third):
    trained = second["cross/ggg2_trained"]
    assert sorted(trained["losses"]) == [4, 5] and all(math.isfinite(v) for v in trained["losses"].values())
    loaded = third["cross/iig4_loaded"]
    assert loaded["resumed_from"] == 5 and loaded["losses"] == {}
    _assert_same_state(trained, loaded)
