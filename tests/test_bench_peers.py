"""tools.bench.peers: the registry, the missing-venv error, the patch table's documentation, the
memory count; and (slow, when the venv exists) one tiny peer run checked against one process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tools.bench.peers as peers
from tools.bench.peers import PEERS, RELEASES, MissingVenv, check_peers, missing_venv_line, split_baselines
from tools.bench.peers.patches import CONFIG_NOTES, PATCHES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_registry():
    assert {"ds-zero3", "ds-hpz", "ds-mics", "mfsdp-zero3", "mfsdp-hsdp", "mfsdp-hfsdp"} <= set(PEERS)
    for p in PEERS.values():
        assert p.release in RELEASES and p.system in ("deepspeed", "mfsdp") and p.label
    # the pins the issue names: MiCS on 0.19.0, the rest of DeepSpeed on 0.19.8, Megatron-FSDP 0.6.1
    assert PEERS["ds-mics"].release == "ds-0.19.0" and "deepspeed==0.19.0" in RELEASES["ds-0.19.0"].pins
    assert "deepspeed==0.19.8" in RELEASES[PEERS["ds-zero3"].release].pins
    assert "megatron-fsdp==0.6.1" in RELEASES[PEERS["mfsdp-hfsdp"].release].pins
    assert peers.TORCH_PIN == "torch==2.13.0"
    assert split_baselines(["fsdp2-zero3", "ds-zero3", "ddp", "mfsdp-hsdp"]) == (["fsdp2-zero3", "ddp"],
                                                                                  ["ds-zero3", "mfsdp-hsdp"])


def test_missing_venv_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(peers, "VENV_DIR", str(tmp_path / "none"))
    line = missing_venv_line("ds-mics")
    assert "\n" not in line and peers.SETUP_CMD in line and "ds-0.19.0" in line
    with pytest.raises(MissingVenv) as e:
        check_peers(["ds-mics"])
    assert str(e.value) == line
    # the bench's own command line exits 2 with that one line, before building anything
    from tools.bench import headline

    with pytest.raises(SystemExit) as e2:
        headline._args(["--baselines", "fsdp2-zero3,ds-mics"])
    assert e2.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {line}"


def test_bench_args_split(monkeypatch, tmp_path):
    for rel in RELEASES:  # fake venvs: only the python's presence is checked
        os.makedirs(tmp_path / RELEASES[rel].venv / "bin")
        (tmp_path / RELEASES[rel].venv / "bin" / "python").write_text("")
    monkeypatch.setattr(peers, "VENV_DIR", str(tmp_path))
    from tools.bench import headline

    a = headline._args(["--baselines", "fsdp2-hsdp,mfsdp-hsdp,ds-zero3"])
    assert a.baselines == "fsdp2-hsdp" and a.peers == ["mfsdp-hsdp", "ds-zero3"]
    with pytest.raises(SystemExit):
        headline._args(["--baselines", "ds-zero3", "--dtype", "bf16"])  # the peers run fp32 only


def test_patch_table_is_documented():
    doc = open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    for name, p in PATCHES.items():
        assert p.reason.strip() and p.what.strip() and callable(p.apply)
        assert set(p.peers) <= set(PEERS), name
        assert f"`{name}`" in doc, f"patch {name} is not in docs/benchmarks.md"
        if p.approximate:  # an approximate stand-in only on peers marked approximate
            assert all(PEERS[q].approximate for q in p.peers), name
    assert "gradient_reduce_div_fusion" in doc and CONFIG_NOTES["mfsdp"]
    for name in PEERS:
        assert f"`{name}`" in doc, f"peer {name} is not in docs/benchmarks.md"
    out = subprocess.run([sys.executable, "-m", "tools.bench.peers", "list"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert all(n in out for n in PATCHES) and all(n in out for n in PEERS)


def test_patches_switch_off(monkeypatch):
    from tools.bench.peers.patches import active

    assert active(PEERS["mfsdp-hfsdp"], set()) == {"mfsdp-cuda-noops", "mfsdp-adam-step", "mfsdp-hfsdp-grad-scale"}
    assert "mfsdp-hfsdp-grad-scale" not in active(PEERS["mfsdp-hfsdp"], {"mfsdp-hfsdp-grad-scale"})
    monkeypatch.setenv("PARO_PEERS_NO_PATCH", "mics-coalesced-gather")
    assert active(PEERS["ds-mics"], set()) == set()
    assert active(PEERS["ds-zero3"], set()) == set()


def test_state_bytes_counts_each_storage_once():
    import torch

    from tools.bench.peers.worker import state_bytes

    lin = torch.nn.Linear(4, 4, bias=False)
    lin.register_buffer("table", torch.zeros(1000))  # a module buffer: not a model state
    flat = torch.zeros(32)
    opt = torch.optim.AdamW(lin.parameters())
    lin.weight.grad = torch.ones(4, 4)
    opt.step()  # two 16-element moments and a step count
    holder = type("H", (), {})()
    holder.__class__.__module__ = "tools.bench.peers.fake"
    holder.views = [flat[:16], flat[16:]]  # two views of one buffer: counted once
    n = state_bytes(lin, opt, holder)
    assert n == 4 * (16 + 16 + 16 + 16 + 32) + 4  # weight, grad, exp_avg, exp_avg_sq, flat, step


@pytest.mark.slow
def test_tiny_peer_step_matches_one_process():
    rel = PEERS["ds-zero3"].release
    if not os.path.exists(peers.venv_python(rel)):
        pytest.skip(missing_venv_line("ds-zero3"))
    argv = [sys.executable, "-m", "tools.bench.peers", "run", "--peers", "ds-zero3", "--no-emulator", "--steps", "2",
            "--accum", "1", "--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
            "--vocab", "64", "--seq", "16", "--batch", "1"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "check ok" in out.stdout
