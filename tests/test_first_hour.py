"""The first hour with the trainer, as a new user meets it: a bad ``make train NPROC=3`` keeps the
last run's outputs, a configuration error under torchrun is one line and one failure in
torchrun's summary, ``python train.py`` without torchrun names the torchrun command, a dataset
path is never ignored, profiling is off by default and bounded, and SIGTERM / SIGINT (a
scheduler's pre-emption, Ctrl-C) save the step every rank reached and resume from it exactly.

The signal runs share one module fixture: a torchrun SIGTERMed (A), the same command again,
stopped with Ctrl-C to its process group (B), and four ranks started here without torchrun and
SIGTERMed one by one at different times, one never (C: every rank's exit status is visible, and
it is the uninterrupted reference of A and B's losses, fp32 on CPU: bit-identical).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
for p in (str(REPO), str(Path(__file__).parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

from tools.local_world import losses_by_attempt  # noqa: E402
from workloads import TRAINER_ARGS  # noqa: E402

DEBUG = "train_configs/debug_paro.toml"
# the debug model, 4 ranks = 2 groups x 2 (IIG), every step logged, a constant lr after warmup
ARGS = [*TRAINER_ARGS, "--training.steps", "10000", "--checkpoint.enable", "--checkpoint.interval", "1000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MAKELEVEL"):
    ENV.pop(_key, None)
STEP_LINE = r"^step\s+{}/10000"


class Proc:
    """A process in its own session (so a Ctrl-C can go to its whole process group) whose
    output is read as it comes."""

    def __init__(self, cmd: list[str], env: dict | None = None) -> None:
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(line.rstrip("\n") for line in self.proc.stdout), daemon=True
        )
        self._reader.start()

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = rx.search(line)
                if m:
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} (rc {self.proc.poll()}):\n" + "\n".join(self.lines[-60:]))

    def finish(self, timeout: float = 120) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _torchrun(argv: list[str], nproc: int = 4) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "train.py",
        *argv,
    ]


# ---- 1. nothing is deleted before the config is valid ---------------------------------------------
def test_make_train_checks_the_config_before_torchrun_and_deletes_nothing_itself():
    out = subprocess.run(
        ["make", "-n", "train", "NPROC=3"], cwd=REPO, capture_output=True, text=True, timeout=60
    ).stdout
    lines = [ln for ln in out.splitlines() if "train.py" in ln]
    assert "rm -rf" not in out, out
    assert len(lines) == 2 and "--check-config --world 3" in lines[0] and "torchrun" in lines[1], out
    assert lines[1].rstrip().endswith("--job.fresh"), out  # the debug config afresh: the trainer does it, once valid
    resumed = subprocess.run(
        ["make", "-n", "train", "RESUME=1"], cwd=REPO, capture_output=True, text=True, timeout=60
    ).stdout
    assert "--job.fresh" not in resumed, resumed


def _previous_run(dump: Path) -> set[str]:
    for sub in ("checkpoint/step-50", "tb/run1", "profile_traces"):
        (dump / sub).mkdir(parents=True)
    (dump / "checkpoint/step-50/.metadata").write_text("x")
    (dump / "metrics.jsonl").write_text("{}\n")
    return {str(p.relative_to(dump)) for p in dump.rglob("*")}


def test_bad_config_with_fresh_keeps_the_previous_outputs_and_says_one_line(tmp_path):
    """`make train NPROC=3`'s two steps by hand: the check (status 2, one line), then torchrun
    itself given the same bad world (the trainer's line first, torchrun's summary naming one
    failure, rank 0's status 2, with that line as its traceback). Nothing deleted by either."""
    dump = tmp_path / "run"
    before = _previous_run(dump)
    argv = ["--job.config_file", DEBUG, "--job.dump_folder", str(dump), "--job.fresh"]
    check = subprocess.run([sys.executable, "train.py", *argv, "--check-config", "--world", "3"], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 2 and check.stdout == "", check
    assert check.stderr.splitlines() == [check.stderr.strip()] and check.stderr.startswith(
        "train.py: error: training.global_batch_size = 32 is not a multiple"), check.stderr
    run = subprocess.run(_torchrun(argv, nproc=3), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    out = (run.stderr + run.stdout).splitlines()
    assert run.returncode == 1, run  # torchrun's own status when a worker failed
    assert out[0] == check.stderr.strip(), out[:3]
    assert sum("train.py: error:" in ln for ln in out) == 2, out  # the line, and the summary's traceback field
    assert "  <NO_OTHER_FAILURES>" in out and sum(ln.startswith("  exitcode  :") for ln in out) == 1, out
    assert any(ln.startswith("  exitcode  : 2 ") for ln in out) and not any("SIGTERM" in ln for ln in out), out
    assert len(out) <= 40, len(out)  # was 48 (3 ranks) / 55 (4 ranks)
    assert {str(p.relative_to(dump)) for p in dump.rglob("*")} == before


def test_python_without_torchrun_names_the_torchrun_command():
    proc = subprocess.run([sys.executable, "train.py", "--job.config_file", DEBUG], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("train.py: error: train.py was started without torchrun"), line
    assert line.endswith(
        f"run it under torchrun: torchrun --standalone --nproc-per-node 4 train.py --job.config_file {DEBUG}"
    )


# ---- 5. a dataset path is never ignored -----------------------------------------------------------
def test_dataset_path_implies_its_format(tmp_path):
    from paro_fsdp.train.config_parse import ConfigError, parse_args

    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "c.jsonl").write_text('{"text": "hello"}\n')
    for path, want in (("a.txt", "text"), ("b.jsonl", "jsonl"), ("docs", "jsonl")):
        cfg, _ = parse_args(
            ["--job.config_file", str(REPO / DEBUG), "--training.dataset_path", str(tmp_path / path)], 4
        )
        assert (cfg.training.dataset, cfg.training.dataset_path) == (want, str(tmp_path / path))
    with pytest.raises(ConfigError, match="--training.dataset embedded"):
        parse_args(["--training.dataset", "embedded", "--training.dataset_path", str(tmp_path / "a.txt")], 4)


# ---- 4. profiling off by default, bounded ---------------------------------------------------------
def test_debug_config_does_not_profile_and_traces_are_bounded(tmp_path):
    import torch

    from paro_fsdp.train.config_parse import parse_args
    from paro_fsdp.train.metrics import build_profiler

    cfg, _ = parse_args(["--job.config_file", str(REPO / DEBUG)], 4)
    p, c = cfg.profiling, cfg.checkpoint
    assert not p.enable_profiling and c.interval % p.profile_freq  # when enabled, traced steps are not save steps
    cfg, _ = parse_args(
        [
            "--job.dump_folder",
            str(tmp_path),
            "--profiling.enable_profiling",
            "--profiling.profile_freq",
            "1",
            "--profiling.keep_latest_k",
            "2",
        ],
        1,
    )
    with build_profiler(cfg, 0, torch.device("cpu"), 0) as prof:
        for _ in range(5):
            torch.ones(8).sum()
            prof.step()
    assert len(list((tmp_path / "profile_traces").glob("rank0.*.pt.trace.json"))) == 2


# ---- 3. SIGTERM and SIGINT: the step every rank reached, saved; resumed exactly --------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("first_hour")
    out: dict = {"tmp": tmp}
    argv = ARGS + ["--job.dump_folder", str(tmp / "a")]
    # A: SIGTERM to torchrun (a scheduler's pre-emption) once step 3 is logged
    a = Proc(_torchrun(argv))
    try:
        a.wait_for(STEP_LINE.format(3))
        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        out["a"] = {"rc": a.finish(), "s": time.monotonic() - t0, "lines": a.lines}
    finally:
        a.kill()
    out["a"]["kept"] = sorted(os.listdir(tmp / "a" / "checkpoint"))
    # B: the same command resumes; Ctrl-C (SIGINT to the process group: torchrun and every rank) 2 steps later
    b = Proc(_torchrun(argv))
    try:
        m = b.wait_for(r"resumed from .*/step-(\d+)$")
        b.wait_for(STEP_LINE.format(int(m.group(1)) + 2))
        os.killpg(b.proc.pid, signal.SIGINT)
        out["b"] = {"rc": b.finish(), "lines": b.lines}
    finally:
        b.kill()
    out["b"]["kept"] = sorted(os.listdir(tmp / "a" / "checkpoint"))
    out["losses"] = losses_by_attempt(str(tmp / "a" / "metrics.jsonl"))
    # C: 4 ranks started here (their exit status is ours to see); --job.fresh over a stale run;
    # a trace of the checkpoint step 4; SIGTERM to ranks 3, 1, 0 at different times, never to 2
    dump = tmp / "c"
    (dump / "checkpoint" / "step-2000").mkdir(parents=True)
    (dump / "metrics.jsonl").write_text('{"step": 2000, "loss/train": 1.0}\n')
    port, procs = _free_port(), []
    argv_c = ARGS + ["--job.dump_folder", str(dump), "--job.fresh", "--checkpoint.interval", "4",
                     "--profiling.enable_profiling", "--profiling.profile_freq", "4"]
    try:
        for r in range(4):
            env = {**ENV, "RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(Proc([sys.executable, "train.py", *argv_c], env=env))
        last = max(max(run) for run in out["losses"])
        procs[0].wait_for(STEP_LINE.format(last + 1))
        for r in (3, 1, 0):
            procs[r].proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        out["c"] = {"rc": [p.finish() for p in procs], "lines": [p.lines for p in procs]}
    finally:
        for p in procs:
            p.kill()
    out["c"]["kept"] = sorted(os.listdir(dump / "checkpoint"))
    out["c"]["losses"] = losses_by_attempt(str(dump / "metrics.jsonl"))
    out["c"]["traces"] = sorted((dump / "profile_traces").glob("rank0.*.pt.trace.json"))
    return out


def _stop_line(lines: list[str], name: str) -> re.Match:
    said = [
        re.search(
            rf"^\[paro\] stopped by {name} \(\d of 4 ranks got it\) at step (\d+)/10000, "
            r"which every rank finished; saved (\S+) in ([\d.]+) s; resume with: (.*)$",
            ln,
        )
        for ln in lines
    ]
    said = [m for m in said if m]
    assert len(said) == 1, "\n".join(lines[-40:])
    return said[0]


@pytest.mark.slow  # the stopped torchrun runs (about a minute): make test-all
def test_sigterm_to_torchrun_saves_the_step_reached_and_names_the_command(stopped):
    a = stopped["a"]
    m = _stop_line(a["lines"], "SIGTERM")
    step = int(m.group(1))
    assert step >= 4 and step % 1000 and a["kept"] == [f"step-{step}"]  # not an interval step: the one it stopped at
    assert m.group(2).endswith(f"/a/checkpoint/step-{step}")
    dump = stopped["tmp"] / "a"
    assert m.group(4) == "torchrun --standalone --nproc-per-node 4 train.py " + " ".join(
        ARGS + ["--job.dump_folder", str(dump)]
    )
    assert not [ln for ln in a["lines"] if "train.py: error" in ln or "SIGKILL" in ln], a["lines"]
    assert a["rc"] == 1  # torchrun's own status after a SIGTERM (it re-raises SignalException): not the workers'
    assert a["s"] < 25, a["s"]  # well inside torchrun's 30 s before SIGKILL
    print(f"SIGTERM -> torchrun gone: {a['s']:.1f} s; save of step {step}: {m.group(3)} s")


@pytest.mark.slow  # the stopped torchrun runs (about a minute): make test-all
def test_ctrl_c_then_resume_continues_exactly(stopped):
    b, losses, reference = stopped["b"], stopped["losses"], stopped["c"]["losses"][-1]
    first = int(_stop_line(stopped["a"]["lines"], "SIGTERM").group(1))
    m = _stop_line(b["lines"], "SIGINT")
    step = int(m.group(1))
    assert step > first + 1 and b["kept"] == [f"step-{first}", f"step-{step}"]
    assert any(re.search(rf"resumed from .*/step-{first}$", ln) for ln in b["lines"])
    (run,) = losses  # metrics.jsonl: steps 1..first, then first + 1..step (a resume appends, no step twice)
    assert sorted(run) == list(range(1, step + 1))
    assert run == {s: reference[s] for s in run}  # before the stop and after the resume: bit-identical, uninterrupted
    assert not [ln for ln in b["lines"] if "train.py: error" in ln or "SIGKILL" in ln], b["lines"]
    assert b["rc"] == 1  # torchrun's own status after a SIGINT, as after a SIGTERM


@pytest.mark.slow  # the stopped torchrun runs (about a minute): make test-all
def test_every_rank_exits_0_at_one_agreed_step_however_the_signals_arrive(stopped):
    c = stopped["c"]
    assert c["rc"] == [0, 0, 0, 0], (c["rc"], [lines[-5:] for lines in c["lines"]])
    m = _stop_line(c["lines"][0], "SIGTERM")
    step = int(m.group(1))
    assert f"step-{step}" in c["kept"] and all(int(k[5:]) % 4 == 0 for k in c["kept"] if k != f"step-{step}"), c["kept"]
    assert "step-2000" not in c["kept"] and len(c["losses"]) == 1 and min(c["losses"][0]) == 1  # job.fresh removed them
    assert any("job.fresh: removed the previous run's" in ln for ln in c["lines"][0])
    for r in (1, 2, 3):  # only rank 0 speaks
        assert not [ln for ln in c["lines"][r] if "error" in ln or "stopped" in ln], c["lines"][r]


@pytest.mark.slow  # the stopped torchrun runs (about a minute): make test-all
def test_a_traced_step_does_not_trace_its_checkpoint(stopped):
    """profile_freq 4 and checkpoint.interval 4: steps 4 and 8 are traced and saved; the save's
    collectives (barriers, DCP's gathers and broadcasts of its plan) are not in their traces,
    only the step's own: the engine's all-gathers and reduce-scatters, the loss and norm all-reduces."""
    traces = stopped["c"]["traces"]
    assert traces
    for trace in traces:
        names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
        assert any(n.startswith("ProfilerStep#") for n in names)
        c10d = {n for n in names if n.startswith("c10d::")}
        assert c10d <= {"c10d::_allgather_base_", "c10d::reduce_scatter_tensor_coalesced_", "c10d::allreduce_"}, c10d
