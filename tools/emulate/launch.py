"""Run a command on every node of an emulated cluster (``emulator.py``): one ``torchrun`` per
node inside its network namespace, node 0's output streamed, every node's log kept, the first
failure stops the others; and the command line of ``python -m tools.emulate``.

Why apart from ``emulator.py``: that module builds and tears down the namespaces and links; this
one starts, watches and stops processes inside them (and the rails' per-rank shim that picks
each local rank's interface before it becomes the training script).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Callable

from .emulator import (MASTER_PORT, TOPOLOGIES, Emulator, EmulatorError, check_privileges,
                       cleanup_leftovers)

#: the command line that relaunches this module's ``main`` (the rails' rank shim)
CLI = "tools.emulate"


# ---- launching ------------------------------------------------------------------------------
def torchrun_argv(emu: Emulator, node: int, command: list[str], torchrun: str, master_port: int) -> list[str]:
    """One node's torchrun. Static rendezvous at node 0's address; rails need the rank shim."""
    argv = [torchrun, "--nnodes", str(emu.nodes), "--node-rank", str(node), "--nproc-per-node",
            str(emu.ranks_per_node), "--master-addr", emu.master_addr, "--master-port", str(master_port)]
    if node == 0:
        argv += ["--local-ranks-filter", "0"]  # stream rank 0 only; the other ranks go to the log
    if command and command[0] == "-m":
        target = ["-m", *command[1:]]
    else:
        target = list(command)
    if emu.topology == "rails":
        # every local rank needs its own GLOO_SOCKET_IFNAME: start it through the shim
        return argv + ["-m", CLI, "--rank-shim", *target]
    return argv + target


def _pump(src: IO[bytes], log: IO[bytes], out: IO[bytes] | None, mute: threading.Event) -> None:
    for line in iter(src.readline, b""):
        log.write(line)
        log.flush()
        if out is not None and not mute.is_set():
            out.write(line)
            out.flush()


def _failure_excerpt(text: str, first: int = 40, last: int = 12) -> str:
    """The first worker traceback (the root cause; torchrun's own summary only links to it)
    and the last lines of a node's log."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    if start is None or start >= len(lines) - last:
        return "\n".join(lines[-(first + last):])
    return "\n".join(lines[start:start + first] + ["    [...]"] + lines[-last:])


def _stop_all(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM each node's process group (torchrun forwards it to its workers and waits for
    them), SIGKILL what is still alive after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


class _Stop(Exception):
    """A signal arrived: unwind through the finally that tears everything down."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def launch(emu: Emulator, command: list[str], launcher: str = "torchrun", torchrun: str | None = None,
           log_dir: str | None = None, timeout: float | None = None, report_bytes: bool = False,
           extra_env: dict[str, str] | None = None, out: IO[bytes] | None = None) -> int:
    """Run ``command`` on every node of an already set-up emulator; return the exit code.

    launcher "torchrun": one torchrun per node; "none": the command itself once per node (with
    NODE_RANK / NNODES / MASTER_ADDR / EMU_ADDR in its environment; for tests and raw probes).
    Node 0's output is streamed to ``out`` (rank 0 only under torchrun) and, like every other
    node's, written to ``log_dir/node<i>.log``. The first node that fails stops the others.
    """
    out = out or sys.stdout.buffer
    torchrun = torchrun or shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    keep_logs = log_dir is not None
    log_dir = log_dir or tempfile.mkdtemp(prefix=f"{emu.prefix}-logs-")
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PARO_EMU_IFNAMES=",".join(emu.gloo_ifnames()),
               GLOO_SOCKET_IFNAME=emu.ifname(0), PARO_EMU_TOPOLOGY=emu.topology, PARO_EMU_RATE=emu.rate,
               PARO_EMU_NODES=str(emu.nodes), PARO_EMU_RANKS_PER_NODE=str(emu.ranks_per_node),
               PARO_EMU_SHAPED=json.dumps(emu.shaped), PYTHONUNBUFFERED="1",
               PARO_EMU_GLOO_RS=env.get("PARO_EMU_GLOO_RS", "all_to_all"))  # gloo_rs.py: a ring's bytes
    if extra_env:
        env.update(extra_env)
    procs: list[subprocess.Popen] = []
    logs: list[IO[bytes]] = []
    pumps: list[threading.Thread] = []
    mute = threading.Event()  # set when we stop the run: node 0's shutdown noise goes to its log only
    before = emu.all_tx_bytes() if report_bytes else {}
    try:
        for i in range(emu.nodes):
            if launcher == "torchrun":
                argv = torchrun_argv(emu, i, command, torchrun, MASTER_PORT)
            else:
                argv = list(command)
            node_env = dict(env, NODE_RANK=str(i), NNODES=str(emu.nodes), MASTER_ADDR=emu.master_addr,
                            MASTER_PORT=str(MASTER_PORT), EMU_ADDR=emu.addr(i, 0))
            log = open(os.path.join(log_dir, f"node{i}.log"), "wb")
            logs.append(log)
            # own session: a terminal's Ctrl-C reaches only us, and we stop the nodes in order
            p = subprocess.Popen(emu.exec_argv(i, argv), env=node_env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, log, out if i == 0 else None, mute), daemon=True)
            t.start()
            pumps.append(t)
        start = time.time()
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            if timeout and time.time() - start > timeout:
                print(f"[emulate] timeout after {timeout:.0f} s: stopping", file=sys.stderr)
                failed = [-1]
                break
            time.sleep(0.2)
        rc = 0
        if failed:
            rc = next((codes[i] for i in failed if i >= 0), 124) or 1
            for i in failed:  # what an exited node still had in its pipe, node 0's error included
                if i >= 0:
                    pumps[i].join(timeout=2)
            mute.set()
            _stop_all(procs)
            for t in pumps:
                t.join(timeout=2)
            for i in failed:
                if i > 0:  # node 0's output was streamed already
                    logs[i].flush()
                    with open(os.path.join(log_dir, f"node{i}.log"), "rb") as f:
                        text = f.read().decode(errors="replace")
                    print(f"[emulate] node {i} exited with {codes[i]}; from {log_dir}/node{i}.log:\n"
                          f"{_failure_excerpt(text)}", file=sys.stderr)
            print(f"[emulate] run failed (exit {rc}); every node's log is in {log_dir}", file=sys.stderr)
            keep_logs = True
        else:
            for t in pumps:  # every node exited: drain the pipes before muting in the finally
                t.join(timeout=5)
        if report_bytes:
            after = emu.all_tx_bytes()
            for key in sorted(after):
                print(f"[emulate] node {key[0]} {emu.ifname(key[1])}: tx {(after[key] - before[key]) / 2**20:.2f} MiB",
                      file=sys.stderr)
        return rc
    finally:
        mute.set()
        _stop_all(procs)
        for t in pumps:
            t.join(timeout=2)
        for log in logs:
            log.close()
        if not keep_logs:  # a temp dir of a run that went fine: nothing to look at
            shutil.rmtree(log_dir, ignore_errors=True)


class ResultTee(io.RawIOBase):
    """Stream node 0's output to the terminal while keeping it for parsing: the benchmarks'
    machine-readable line (it starts with ``tag``) is kept but not shown."""

    def __init__(self, tag: str) -> None:
        self.tag = tag.encode()
        self.buf = bytearray()

    def write(self, b) -> int:  # type: ignore[override]
        self.buf += b
        if not bytes(b).startswith(self.tag):
            sys.stdout.buffer.write(b)
            sys.stdout.buffer.flush()
        return len(b)

    def flush(self) -> None:
        pass

    def tagged(self) -> list[str]:
        """The payloads (after the tag) of every tagged line, in order."""
        n = len(self.tag)
        return [
            line[n:] for line in self.buf.decode(errors="replace").splitlines() if line.startswith(self.tag.decode())
        ]


def worker_or_driver(argv: list[str] | None, parse: Callable[[list[str]], Any], worker: Callable[[Any], None],
                     driver: Callable[[Any, list[str]], int]) -> int:
    """The ``main`` of a benchmark on the emulator: with ``--worker`` or under torchrun (RANK set,
    through the emulator or not) this rank's side, else the driver that builds the emulator and
    starts the workers on it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    is_worker = "--worker" in argv
    if is_worker:
        argv.remove("--worker")
    args = parse(argv)
    if is_worker or "RANK" in os.environ:
        worker(args)
        return 0
    return driver(args, argv)


def rank_shim(argv: list[str]) -> None:
    """Inside torchrun (rails): pick this local rank's interface, then become the script."""
    import runpy

    names = os.environ.get("PARO_EMU_IFNAMES", "").split(",")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if names and names[0]:
        os.environ["GLOO_SOCKET_IFNAME"] = names[local % len(names)]
    if not argv:
        raise SystemExit("--rank-shim needs a script (or -m module) to run")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.emulate",
        description="Run a torchrun job on an emulated multi-node cluster (network namespaces + tc). Needs root.",
        epilog="Everything after -- is the training command, as given to torchrun (script and its arguments, "
               "or -m module ...).")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-rate", default="200mbit", help="per-link rate, tc syntax (200mbit, 1gbit)")
    p.add_argument("--inter-delay", default=None, help="one-way delay between nodes, tc syntax (1ms); needs netem")
    p.add_argument("--require-delay", action="store_true", help="fail instead of running rate-only without netem")
    p.add_argument("--topology", choices=TOPOLOGIES, default="shared")
    p.add_argument("--tcp-congestion", default=None,
                   help="TCP congestion control inside the nodes (cubic, bbr, reno; default: the kernel's)")
    p.add_argument("--tcp-slow-start-after-idle", action="store_true",
                   help="keep Linux's slow-start restart after idle (off by default inside the emulated nodes)")
    p.add_argument("--launcher", choices=("torchrun", "none"), default="torchrun",
                   help="none: run the command itself once per node (env NODE_RANK, NNODES, MASTER_ADDR, EMU_ADDR)")
    p.add_argument("--torchrun", default=None, help="torchrun executable (default: the one next to this python)")
    p.add_argument("--log-dir", default=None, help="per-node logs (default: a fresh temp dir)")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument("--report-bytes", action="store_true", help="print the tx bytes of every link after the run")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by crashed runs, then exit")
    p.add_argument("--all", action="store_true", help="with --cleanup: also namespaces of runs still alive")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank-shim"]:
        rank_shim(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        check_privileges()
        if args.cleanup:
            cleanup_leftovers(all_runs=args.all)
            return 0
        if not command:
            raise EmulatorError("nothing to run: give the command after --")
    except EmulatorError as e:
        print(f"[emulate] error: {e}", file=sys.stderr)
        return 2

    stopping = []

    def on_signal(signum, _frame):
        if stopping:  # already unwinding: let the teardown finish rather than abort it halfway
            print(f"[emulate] {signal.Signals(signum).name}: still cleaning up, please wait", file=sys.stderr)
            return
        stopping.append(signum)
        raise _Stop(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with Emulator(args.nodes, args.ranks_per_node, args.inter_rate, args.inter_delay, args.topology,
                      args.require_delay, args.tcp_slow_start_after_idle, args.tcp_congestion) as emu:
            if args.launcher == "torchrun" and args.torchrun is None:
                local = os.path.join(os.path.dirname(sys.executable), "torchrun")
                args.torchrun = local if os.path.exists(local) else None
            return launch(emu, command, args.launcher, args.torchrun, args.log_dir, args.timeout, args.report_bytes)
    except EmulatorError as e:
        print(f"[emulate] error: {e}", file=sys.stderr)
        return 2
    except _Stop as e:
        print(f"[emulate] {e}: stopped, namespaces removed", file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)
