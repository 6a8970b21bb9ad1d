"""Hostile checkpoint folders: whatever a folder holds, reading it runs nothing, and each one is
refused in one line. Every pickle protocol 0-5, GLOBAL and STACK_GLOBAL, dotted names (DCP's
metadata module imports ``os``: ``os.system`` is its attribute), a module attribute, INST / OBJ
/ NEWOBJ / BUILD, REDUCE on an allowed class with an argument that would run the command, and
the manifest rewritten to match the hostile file. Each goes through every reading entry point
of the project: the reader, ``safe_load``, the trainer's resume (``CheckpointManager.load``),
``checkpoint.initial_load_path`` (``load_model_weights``) and the torchtitan plug-in. Single
process; the trainer's resume on 4 gloo ranks is in ``test_faults.py``."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from hostile_pickles import cases, opcodes, protocol  # noqa: E402

from paro_fsdp.train.checkpoint import CheckpointManager, load_model_weights  # noqa: E402
from paro_fsdp.checkpoint_files import MANIFEST, CheckpointError, SafeReader, safe_load  # noqa: E402

CASES = cases()
OPCODE = {"GLOBAL": "GLOBAL", "STACK_GLOBAL": "STACK_GLOBAL", "INST": "INST", "OBJ": "OBJ", "NEWOBJ": "NEWOBJ",
          "BUILD": "BUILD", "REDUCE": "REDUCE"}


def _states() -> dict:
    return {
        "optimizer": {
            "master": {"w": torch.arange(6.0).reshape(2, 3)},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}],
        },
        "train_state": {"step": 2},
    }


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> str:
    """A real checkpoint of the trainer's checkpoint manager: step-2 with its manifest."""
    root = tmp_path_factory.mktemp("sound")
    CheckpointManager(str(root), 1, 0, True, _states()).save(2)
    return str(root / "step-2")


def _hostile(sound: str, root: Path, data: bytes, manifest: str = "rewrite") -> str:
    """A copy of ``sound`` as ``root/checkpoint/step-2`` whose ``.metadata`` is ``data``; the
    manifest rewritten to match it (what anyone who can write the folder can do), kept, or deleted."""
    folder = root / "checkpoint" / "step-2"
    shutil.copytree(sound, folder)
    (folder / ".metadata").write_bytes(data)
    if manifest == "rewrite":
        m = json.loads((folder / MANIFEST).read_text())
        m["files"][".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        (folder / MANIFEST).write_text(json.dumps(m))
    elif manifest == "delete":
        (folder / MANIFEST).unlink()
    return str(folder)


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


def test_each_pickle_holds_the_opcode_and_protocol_it_is_named_after():
    assert len(CASES) >= 40
    for name, build in CASES.items():
        data = build("/nonexistent/sentinel")
        proto, kind = int(name[1]), name.split("-")[1]
        ops = opcodes(data)  # pickletools parses it: a well-formed pickle, disassembled without running it
        assert OPCODE[kind] in ops, (name, ops)
        assert protocol(data) == (proto if proto >= 2 else 0), name
        assert ("dotted" in name) == (b"os.system" in data), name
    assert {n.split("-")[0] for n in CASES} == {f"p{p}" for p in range(6)}


def _refusal(fn, sentinel: Path) -> str:
    """The one-line CheckpointError message ``fn`` raises; first of all, the command never ran."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - checked below, after the sentinel
        raised = exc
    else:
        raised = None
    assert not sentinel.exists(), "the hostile pickle ran its command"
    assert isinstance(raised, CheckpointError), repr(raised)[:500]
    return _one_line(raised)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_metadata_runs_nothing_and_is_refused_in_one_line(name, sound, tmp_path):
    sentinel = tmp_path / "ran"
    folder = _hostile(sound, tmp_path, CASES[name](str(sentinel)))
    refused = f"{folder}/.metadata: not a DCP metadata file this trainer will read (global "

    msg = _refusal(lambda: SafeReader(folder).read_metadata(), sentinel)  # the reader
    assert msg.startswith(refused) and ("not part of DCP metadata" in msg or "a dotted name" in msg), msg
    assert _refusal(lambda: safe_load(_states(), folder), sentinel).startswith(refused)  # the one entry point
    # the trainer's resume, manifest rewritten to match
    msg = _refusal(lambda: CheckpointManager(str(tmp_path / "checkpoint"), 1, 0, True, _states()).load(), sentinel)
    assert msg.startswith(f"checkpoint {folder} is refused: {refused}"), msg
    msg = _refusal(lambda: load_model_weights(torch.nn.Linear(3, 2), folder), sentinel)  # checkpoint.initial_load_path
    assert msg.startswith(f"checkpoint.initial_load_path {folder} is refused: {refused}"), msg
    assert msg.endswith("; point checkpoint.initial_load_path at an intact checkpoint folder, or leave it empty"), msg


def test_the_dotted_name_really_runs_under_a_full_unpickler(tmp_path):
    """The cases are live: what DCP's own reader (``pickle.load``) would do with them."""
    for name in ("p4-GLOBAL-dotted", "p5-STACK_GLOBAL-dotted", "p4-INST-dotted", "p5-OBJ-dotted"):
        sentinel = tmp_path / name
        try:
            pickle.loads(CASES[name](str(sentinel)))
        except Exception:  # noqa: BLE001 - the command ran before whatever fails after it
            pass
        assert sentinel.exists(), name


def test_without_a_manifest_nothing_is_read_and_the_flag_is_named(sound, tmp_path):
    """A resume of a folder without the manifest is refused before ``.metadata`` is opened;
    ``--checkpoint.verify false`` (named in the message) reads it, still with the safe reader."""
    sentinel = tmp_path / "ran"
    folder = _hostile(sound, tmp_path, CASES["p4-GLOBAL-dotted"](str(sentinel)), manifest="delete")
    msg = _refusal(CheckpointManager(str(tmp_path / "checkpoint"), 1, 0, True, _states()).load, sentinel)
    assert msg.startswith(f"checkpoint {folder} has no {MANIFEST}, so its files cannot be verified"), msg
    assert "--checkpoint.verify false" in msg
    unverified = CheckpointManager(str(tmp_path / "checkpoint"), 1, 0, True, _states(), verify=False)
    assert "is refused: " in _refusal(unverified.load, sentinel)


def test_a_storage_entry_outside_the_folder_is_refused(sound, tmp_path):
    """``.metadata`` names the files DCP reads: one pointing elsewhere would load any file on
    the machine into the weights. Built from the sound metadata, only the path changed."""
    metadata = SafeReader(sound).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere/__0_0.distcp"
    folder = _hostile(sound, tmp_path, pickle.dumps(metadata, protocol=4))
    with pytest.raises(
        CheckpointError, match=r"storage entry '\.\./\.\./elsewhere/__0_0\.distcp' lies outside the checkpoint folder"
    ):
        SafeReader(folder).read_metadata()


def test_values_are_deserialised_with_weights_only_and_nothing_else(sound, monkeypatch):
    """Non-tensor values (param groups, step) reach the state through ``torch.load(weights_only=
    True)`` alone: DCP's own planner would unpickle them again with ``weights_only=False``."""
    calls = []
    real = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    state = _states()
    state["optimizer"]["param_groups"] = [{"lr": 0.0, "betas": (0.0, 0.0)}]
    state["train_state"]["step"] = 0
    safe_load(state, sound)
    assert (
        state["optimizer"]["param_groups"] == [{"lr": 1e-3, "betas": (0.9, 0.95)}] and state["train_state"]["step"] == 2
    )
    assert calls and all(c is True for c in calls), calls


def test_a_sound_checkpoint_loads_through_every_entry_point(sound, tmp_path):
    shutil.copytree(sound, tmp_path / "checkpoint" / "step-2")
    state = _states()
    state["optimizer"]["master"]["w"] = torch.zeros(2, 3)
    assert CheckpointManager(str(tmp_path / "checkpoint"), 1, 0, True, state).load() == 2
    assert torch.equal(state["optimizer"]["master"]["w"], torch.arange(6.0).reshape(2, 3))


def test_initial_load_path_without_a_manifest_loads_with_one_warning(tmp_path):
    """A folder written by plain DCP (as torchtitan's) has no manifest: it loads, with one line
    saying its files could not be verified; its shapes are still checked."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(3, 2)
    dcp.save({k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}, checkpoint_id=str(tmp_path / "plain"))
    warned: list[str] = []
    what = load_model_weights(model, str(tmp_path / "plain"), warn=warned.append)
    assert what == "model weights" and torch.equal(model.weight.detach(), torch.full((2, 3), 7.0))
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert f"has no {MANIFEST}" in warned[0] and "could not be verified" in warned[0]
    warned.clear()
    load_model_weights(model, str(tmp_path / "plain"), verify_files=False, warn=warned.append)
    assert warned == []  # checkpoint.verify false: asked not to check


def test_an_earlier_trainers_checkpoint_loads_as_weights_and_is_refused_for_resume(tmp_path):
    """A ``step-N`` folder written before the trainer's optimizer became torch's holds the fp32
    masters under ``optimizer.master.<fqn>``: ``initial_load_path`` loads them as weights; a resume
    (whose states now hold ``model.<fqn>``) is refused in one line naming that fix."""
    model = torch.nn.Linear(3, 2)
    old = {"optimizer": {"master": {k: torch.full_like(v, 5.0) for k, v in model.state_dict().items()}},
           "train_state": {"step": 2}}
    CheckpointManager(str(tmp_path / "checkpoint"), 1, 0, True, old).save(2)
    folder = str(tmp_path / "checkpoint" / "step-2")
    what = load_model_weights(model, folder)
    assert what.startswith("the fp32 masters of an earlier paro-fsdp checkpoint") and torch.equal(
        model.weight.detach(), torch.full((2, 3), 5.0))
    states = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "train_state": {"step": 0}}
    with pytest.raises(CheckpointError) as raised:
        CheckpointManager(str(tmp_path / "checkpoint"), 1, 0, True, states).load()
    msg = _one_line(raised.value)
    assert "optimizer.master.*" in msg and f"--checkpoint.initial_load_path {folder}" in msg, msg


def test_safe_load_refuses_a_reader_that_unpickles(sound):
    from torch.distributed.checkpoint import FileSystemReader

    with pytest.raises(TypeError, match="another reader may unpickle .metadata"):
        safe_load(_states(), storage_reader=FileSystemReader(sound))


def test_the_torchtitan_plugin_reads_through_the_safe_reader(sound, tmp_path):
    """``ParoTrainer`` replaces its checkpointer's ``dcp_load`` (resume, initial_load_path, HF)
    with ``safe_dcp_load``: a hostile folder is refused there, unrun; a sound one loads and
    reaches the model's ``load_state_dict``. In a fresh interpreter: torchtitan needs its shims."""
    from paro_fsdp._compat import torch_version

    if torch_version() < (2, 13):
        pytest.skip("torchtitan 0.3 needs torch >= 2.13")
    sentinel = tmp_path / "ran"
    folder = _hostile(sound, tmp_path, CASES["p4-GLOBAL-dotted"](str(sentinel)))
    script = f"""
import sys, types
sys.path.insert(0, {str(HERE / "harness")!r})
import titan_shims  # noqa: F401  (before torchtitan)
import torch
from paro_fsdp.integrations.torchtitan import ParoTrainer
from paro_fsdp.checkpoint_files import CheckpointError
loaded = []
model = types.SimpleNamespace(load_state_dict=loaded.append)
trainer = object.__new__(ParoTrainer)
trainer.checkpointer = types.SimpleNamespace(states={{"model": model}}, sd_adapter=None, dcp_load=None)
trainer.checkpointer.dcp_load = lambda *a: print("torchtitan's own dcp_load")
ParoTrainer._read_checkpoints_safely(trainer)
state = {{"optimizer": {{"master": {{"w": torch.zeros(2, 3)}}}}}}
try:
    trainer.checkpointer.dcp_load(state, {folder!r}, False, False)
except CheckpointError as exc:
    print("refused:", exc)
trainer.checkpointer.dcp_load(state, {sound!r}, False, False)
print("loaded:", state["optimizer"]["master"]["w"].sum().item(), len(loaded))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"refused: {folder}/.metadata: not a DCP metadata file this trainer will read"), lines
    assert lines[1] == "loaded: 15.0 1", lines
    assert not sentinel.exists()
