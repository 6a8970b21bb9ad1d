"""Nothing a user points the trainer at can run code: checkpoints are read without a full
unpickler, and the project never calls one (single process, no distributed world)."""
from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torch.distributed.checkpoint.api import CheckpointException

from paro_fsdp.checkpoint_files import (CheckpointError, SafeLoadPlanner, SafeReader, disk_failure, first_line,
                                       shape_problem)

REPO = Path(__file__).resolve().parent.parent


class _Payload:
    """Unpickling this touches ``marker``: what a crafted checkpoint would do instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_crafted_metadata_is_refused_unrun(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path))
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match="not a DCP metadata file this trainer will read"):
        SafeReader(str(tmp_path)).read_metadata()
    assert not marker.exists()
    pickle.loads((tmp_path / ".metadata").read_bytes())  # what DCP's own reader would have done
    assert marker.exists()


def test_crafted_value_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "extra": _Payload(str(marker))}, checkpoint_id=str(tmp_path / "ck"))
    assert not marker.exists()
    state = {"w": torch.zeros(2), "extra": None}
    with pytest.raises(CheckpointException) as raised:  # DCP wraps what the planner raised
        dcp.load(state, storage_reader=SafeReader(str(tmp_path / "ck")), planner=SafeLoadPlanner())
    assert first_line(raised.value).startswith("rank 0: CheckpointError: checkpoint value extra is not plain data")
    assert not marker.exists()
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"))  # DCP's default planner unpickles it
    assert marker.exists()


def test_plain_values_and_metadata_still_load(tmp_path):
    saved = {
        "w": torch.arange(4.0),
        "meta": {"step": 7, "betas": (0.9, 0.95), "names": ["a"]},
        "rng": torch.get_rng_state(),
    }
    dcp.save(saved, checkpoint_id=str(tmp_path))
    state = {
        "w": torch.zeros(4),
        "meta": {"step": 0, "betas": (0.0, 0.0), "names": []},
        "rng": torch.zeros_like(saved["rng"]),
    }
    dcp.load(state, storage_reader=SafeReader(str(tmp_path)), planner=SafeLoadPlanner())
    assert (
        torch.equal(state["w"], saved["w"])
        and state["meta"] == saved["meta"]
        and torch.equal(state["rng"], saved["rng"])
    )


def test_shape_problem_names_what_differs(tmp_path):
    big = {
        "optimizer": {
            "master": {"layers.0.w": torch.ones(2, 3), "layers.1.w": torch.ones(2, 3), "out.w": torch.ones(5, 3)}
        }
    }
    dcp.save(big, checkpoint_id=str(tmp_path))
    meta = SafeReader(str(tmp_path)).read_metadata()
    assert shape_problem(meta, big) is None
    small = {"optimizer": {"master": {"layers.0.w": torch.ones(2, 3), "out.w": torch.ones(5, 3)}}}
    assert (
        shape_problem(meta, small)
        == "it holds 1 tensors this model lacks, e.g. optimizer.master.layers.1.w (a larger model)"
    )
    wide = {
        "optimizer": {
            "master": {"layers.0.w": torch.ones(2, 4), "layers.1.w": torch.ones(2, 3), "out.w": torch.ones(5, 3)}
        }
    }
    assert shape_problem(meta, wide) == "optimizer.master.layers.0.w is [2, 3] there, [2, 4] here"
    vocab = {"optimizer": {"master": {**big["optimizer"]["master"], "x.output.weight": torch.ones(7, 3)}}}
    assert "it has no tensor optimizer.master.x.output.weight" in shape_problem(meta, vocab)


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


# places that unpickle what this process's own children sent (never a file a user names)
OWN_PROCESSES = {"tools/local_world.py"}  # results of its ranks, off a multiprocessing queue


def test_no_full_unpickler_anywhere_in_the_project():
    """Every torch.load passes weights_only=True; no pickle/marshal load, eval or exec."""
    files = [REPO / "train.py"] + [p for d in ("paro_fsdp", "passes", "tools") for p in (REPO / d).rglob("*.py")]
    problems = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node, owner, name in _calls(tree):
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if owner == "torch" and name == "load":
                kw = {k.arg: k.value for k in node.keywords}
                safe = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                if not safe and str(path.relative_to(REPO)) not in OWN_PROCESSES:
                    problems.append(f"{where}: torch.load without weights_only=True")
            if owner in ("pickle", "marshal", "dill") and name in ("load", "loads"):
                problems.append(f"{where}: {owner}.{name}")
            if owner == "" and name in ("eval", "exec"):
                problems.append(f"{where}: {name}()")
    assert not problems, problems
    assert len(files) > 30


def test_every_checkpoint_load_goes_through_safe_load():
    """DCP's ``load`` (its own reader unpickles ``.metadata`` with a full unpickler, its planner
    every non-tensor value) is called in one place only: ``checkpoint_files.safe_load``. The
    trainer's resume, ``checkpoint.initial_load_path`` and the torchtitan plug-in call that."""
    files = [REPO / "train.py"] + [p for d in ("paro_fsdp", "passes", "tools") for p in (REPO / d).rglob("*.py")]
    calls, users = [], set()
    for path in files:
        rel = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text(), rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.checkpoint"):
                assert not {a.name for a in node.names} & {"load", "load_state_dict"}, f"{rel}:{node.lineno}"
        for node, owner, name in _calls(tree):
            if owner == "dcp" and name in ("load", "load_state_dict"):
                calls.append(rel)
            if name == "safe_load":
                users.add(rel)
    assert calls == ["paro_fsdp/checkpoint_files.py"], calls
    assert {"paro_fsdp/train/checkpoint.py", "paro_fsdp/integrations/torchtitan.py"} <= users, users


def test_a_full_disk_is_named_whichever_rank_saw_it():
    """A full disk reaches one rank as ENOSPC and another as torch's zip writer's short-write
    check; the save error names the disk, not the zip writer (seen on a CI machine)."""
    exc = CheckpointException(
        "save",
        {
            0: (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), None),
            1: (OSError(28, "No space left on device"), None),
        },
    )
    assert first_line(exc).startswith("rank 0: RuntimeError: the disk is full or failing")
    assert first_line(exc, prefer=OSError) == "rank 1: OSError: [Errno 28] No space left on device"
    assert disk_failure(exc)


def test_a_disk_that_fills_inside_torch_save_on_every_rank_is_a_disk_failure():
    """When the disk fills inside torch.save on every rank, no rank sees an OSError: the save is
    still the disk's failure (reported with the folder's fix, not re-raised as a bug; seen in CI)."""
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    exc = CheckpointException("save", {r: (short, None) for r in range(4)})
    assert disk_failure(exc)
    assert first_line(exc, prefer=OSError) == (
        "rank 0: RuntimeError: the disk is full or failing (torch's writer stopped short: unexpected pos 704 vs 598)")
    lost = CheckpointException("save", {1: (RuntimeError("Connection closed by peer"), None)})
    assert not disk_failure(lost)
