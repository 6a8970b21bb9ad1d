"""Emulate a multi-node cluster on one Linux machine: one network namespace per node, shaped
links between nodes, one real ``torchrun`` per node with real gloo traffic.

    python -m tools.emulate --nodes 2 --ranks-per-node 2 --inter-rate 200mbit --inter-delay 1ms \\
        [--topology shared|rails] -- train.py --job.config_file train_configs/debug_paro.toml
    python -m tools.emulate --cleanup          # remove what crashed runs left behind

Why: PaRO's gains come from the gap between fast links inside a node and slow links between
nodes; one machine has no such gap, so we build one. Everything is real kernel networking: TCP
over veth pairs, a Linux bridge as the switch, ``tc`` token-bucket shaping. Ranks inside a node
talk over the namespace's loopback (their peers' addresses are local addresses, so the kernel
routes them through ``lo``: fast, unshaped); ranks on different nodes cross the shaped links.

Topologies (addresses only from the benchmarking range 198.18.0.0/15, only inside namespaces
this tool creates; the host's own interfaces and routes are never touched: every link is
created inside the switch namespace and its node end moved into the node namespace):

  shared  node i: ``eth0`` = 198.18.0.(i+1)/24, one veth to the switch namespace's bridge
          ``br0``. All R ranks of a node share that one uplink (one NIC per node).
  rails   node i: ``rail<j>`` = 198.18.j.(i+1)/24 for j < R, rail j a separate bridge ``br<j>``
          (one NIC per GPU, rail-optimised fabric). Local rank j binds gloo to ``rail<j>``.

How gloo picks its interface, and what we do about it: gloo binds every socket of a process
group to the address of the interface named by GLOO_SOCKET_IFNAME (otherwise: the address the
hostname resolves to, which inside a namespace is useless) and advertises that address to its
peers through the store. ``shared``: all ranks get GLOO_SOCKET_IFNAME=eth0. ``rails``: torchrun
gives every local rank the same environment, so each worker starts through this module's
``--rank-shim`` (``torchrun -m tools.emulate --rank-shim <script> ...``), which sets
GLOO_SOCKET_IFNAME=rail<LOCAL_RANK> and then runs the script as ``__main__``. A connection to a
peer goes to the peer's advertised address, i.e. over the *peer's* rail: traffic between two
ranks with the same local index (PaRO's inter rings) stays on their own rail; traffic between
different local indices (a flat ring's cross-node edges) uses the destination's rail, like a
rail-optimised fabric that forwards cross-rail traffic inside the node (PXN). Check it with
``Emulator.tx_bytes`` / ``--report-bytes``: /sys/class/net/<if>/statistics/tx_bytes per link.

Shaping: every link gets a ``tbf`` of --inter-rate at both ends (node -> switch on the node
end, switch -> node on the switch end), so each node's uplink and downlink are each limited to
the rate, full duplex, and traffic converging on one node shares its downlink. --inter-delay is
the one-way delay, added with ``netem`` on the node -> switch direction only (RTT = 2 x delay).
Kernels without sch_netem (the one this project was built on has tbf and htb, but no netem)
cannot add delay: the tool then says so and runs rate-only, unless --require-delay.

TCP: inside the emulated nodes (per-namespace sysctl, the host is untouched) slow start is not
restarted after idle (--tcp-slow-start-after-idle keeps the kernel default): collectives are
bursts between barriers and compute, and restarting slow start before each would charge a
per-collective ramp that RDMA fabrics do not have — and charge it more to whichever algorithm
sends more, smaller transfers. The kernel's default congestion control (here bbr) is kept.

Teardown: every namespace of a run carries the prefix ``paroemu-<pid>-<hex>``; deleting a
namespace deletes its veth ends and thus the pairs. Exits, failures, Ctrl-C, SIGTERM and SIGHUP
all go through one ``finally`` that stops the per-node torchruns (their process groups, then
every process still inside our namespaces) and deletes the namespaces. A run killed with
SIGKILL cannot clean up: ``--cleanup`` removes namespaces whose creating process is gone
(``--cleanup --all``: every ``paroemu-`` namespace, also of live runs).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Sequence

NS_PREFIX = "paroemu-"
ADDR_BASE = "198.18"  # RFC 2544 benchmarking range 198.18.0.0/15: never routed on the internet
MASTER_PORT = 29500
TOPOLOGIES = ("shared", "rails")
_UNITS = {  # tc's units: "bit" family in bits/s, "bps" family in *bytes*/s
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}



def local_tx_bytes(ifnames: list[str]) -> dict[str, int]:
    """Bytes this network namespace has sent on each of ``ifnames`` (the kernel's counters);
    interfaces that do not exist here are left out."""
    out = {}
    for name in ifnames:
        try:
            with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
                out[name] = int(f.read())
        except OSError:
            pass
    return out


class EmulatorError(RuntimeError):
    """A setup problem the user can fix (root, missing tools, bad arguments)."""


def parse_rate(rate: str) -> float:
    """tc rate string -> bits per second ("200mbit" -> 2e8; "10mbps" is 10 MB/s as in tc)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", rate)
    if not m or (m.group(2).lower() or "bit") not in _UNITS:
        raise EmulatorError(f"cannot parse rate {rate!r}: use tc syntax such as 200mbit, 1gbit, 50mbps")
    return float(m.group(1)) * _UNITS[m.group(2).lower() or "bit"]


def parse_delay(delay: str | None) -> float:
    """tc time string -> seconds ("1ms" -> 0.001); None/"0" -> 0."""
    if not delay:
        return 0.0
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|sec|ms|msec|us|usec)?\s*", delay)
    if not m:
        raise EmulatorError(f"cannot parse delay {delay!r}: use tc syntax such as 1ms, 500us")
    scale = {"s": 1, "sec": 1, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6, None: 1e-6}[m.group(2)]
    return float(m.group(1)) * scale


def check_privileges() -> None:
    """Fail early with the fix, not with an obscure RTNETLINK error halfway through setup."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise EmulatorError(f"tools.emulate needs {' and '.join(missing)} (package iproute2: apt-get install iproute2)")
    if os.geteuid() != 0:
        raise EmulatorError(
            "tools.emulate needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) to create network namespaces, veth "
            "links and tc qdiscs; run it as root, e.g. sudo -E .venv/bin/python -m tools.emulate ..."
        )


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise EmulatorError(f"`{shlex.join(argv)}` failed: {res.stderr.strip() or res.stdout.strip()}")
    return res


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_ns_processes(ns: str, grace: float = 3.0) -> None:
    """Stop every process inside namespace ``ns`` (all of them were started by an emulator run:
    nothing else enters our namespaces): SIGTERM, then SIGKILL after ``grace`` seconds."""
    def pids() -> list[int]:
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        live = pids()
        if not live:
            return
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline and pids():
            time.sleep(0.1)


def delete_namespace(ns: str) -> None:
    _kill_ns_processes(ns)
    _run(["ip", "netns", "delete", ns], check=False)


def cleanup_leftovers(all_runs: bool = False, out: IO[str] = sys.stderr) -> list[str]:
    """Delete ``paroemu-`` namespaces of runs whose process is gone (or of every run)."""
    removed = []
    for ns in list_namespaces():
        if not ns.startswith(NS_PREFIX):
            continue
        m = re.match(rf"{NS_PREFIX}(\d+)-", ns)
        owner_alive = False
        if m:
            try:
                os.kill(int(m.group(1)), 0)
                owner_alive = True
            except ProcessLookupError:
                pass
            except PermissionError:
                owner_alive = True
        if owner_alive and not all_runs:
            print(f"keeping {ns}: its run (pid {m.group(1)}) is still alive; --cleanup --all removes it", file=out)
            continue
        delete_namespace(ns)
        removed.append(ns)
        print(f"removed {ns}", file=out)
    return removed


@dataclass
class Emulator:
    """The namespaces and links of one emulated cluster; a context manager that always tears
    them down. Usable from Python (tests, benchmarks) as well as through the CLI."""

    nodes: int
    ranks_per_node: int
    rate: str = "200mbit"
    delay: str | None = None
    topology: str = "shared"
    require_delay: bool = False
    #: Linux restarts TCP slow start on a connection idle for more than an RTO. Collectives are
    #: bursts separated by compute and barriers, so every collective would start slow, and the
    #: hierarchical one (more, smaller transfers) would pay more; RDMA fabrics have no such
    #: restart. Off by default (per namespace only); True keeps the kernel default.
    slow_start_after_idle: bool = False
    #: TCP congestion control inside the nodes (None: the kernel's default, inherited)
    tcp_congestion: str | None = None
    prefix: str = field(default_factory=lambda: f"{NS_PREFIX}{os.getpid()}-{secrets.token_hex(3)}")
    log: IO[str] = field(default=sys.stderr)
    delay_applied: bool = field(default=False, init=False)
    _created: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise EmulatorError(f"--topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise EmulatorError("--nodes and --ranks-per-node must be >= 1")
        if self.nodes > 250 or (self.topology == "rails" and self.ranks_per_node > 254):
            raise EmulatorError("at most 250 nodes (and 254 rails): one /24 per link layer")
        self.rate_bps = parse_rate(self.rate)
        self.delay_s = parse_delay(self.delay)

    # ---- naming --------------------------------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    @property
    def rails(self) -> int:
        """Links per node: 1 (shared uplink) or one per local rank."""
        return self.ranks_per_node if self.topology == "rails" else 1

    def ifname(self, rail: int = 0) -> str:
        """The node-side interface name of ``rail`` (the same in every node namespace)."""
        return "eth0" if self.topology == "shared" else f"rail{rail}"

    def addr(self, node: int, rail: int = 0) -> str:
        return f"{ADDR_BASE}.{rail}.{node + 1}"

    @property
    def master_addr(self) -> str:
        return self.addr(0, 0)

    def gloo_ifnames(self) -> list[str]:
        """GLOO_SOCKET_IFNAME per local rank."""
        return [self.ifname(j if self.topology == "rails" else 0) for j in range(self.ranks_per_node)]

    # ---- setup / teardown ----------------------------------------------------------------
    def __enter__(self) -> "Emulator":
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _ns_add(self, ns: str) -> None:
        self._created.append(ns)  # first: a signal right after the add must not leak it
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if not self.slow_start_after_idle:  # a per-namespace sysctl: the host keeps its own
            _run(["ip", "netns", "exec", ns, "sh", "-c", "echo 0 > /proc/sys/net/ipv4/tcp_slow_start_after_idle"])
        if self.tcp_congestion:
            _run(["ip", "netns", "exec", ns, "sh", "-c",
                  f"echo {shlex.quote(self.tcp_congestion)} > /proc/sys/net/ipv4/tcp_congestion_control"])

    def _shape(self, ns: str, dev: str, with_delay: bool) -> None:
        """tbf at the link rate (+ netem delay on this direction when asked and available)."""
        rate_Bps = self.rate_bps / 8
        # bucket: >= 2 ms of traffic and >= one 64 KiB GSO segment, so tbf does not split TSO
        # packets into MTU pieces (CPU) nor under-run at high rates; queue: 100 ms of traffic
        burst = int(max(64 * 1024, rate_Bps * 0.002))
        limit = int(max(4 * burst, rate_Bps * 0.1))
        tbf = ["tbf", "rate", self.rate, "burst", str(burst), "limit", str(limit)]
        if with_delay and self.delay_s > 0:
            res = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", self.delay, "limit", "100000"], check=False)
            if res.returncode == 0:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
                self.delay_applied = True
                return
            msg = (f"cannot add delay: the kernel has no netem qdisc ({res.stderr.strip()}); "
                   f"links are rate-limited only")
            if self.require_delay:
                raise EmulatorError(msg)
            if not getattr(self, "_warned_delay", False):
                print(f"[emulate] WARNING: {msg}", file=self.log)
                self._warned_delay = True
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])

    def setup(self) -> None:
        sw = self.switch_ns
        self._ns_add(sw)
        for j in range(self.rails):
            _run(["ip", "-n", sw, "link", "add", f"br{j}", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", f"br{j}", "up"])
        for i in range(self.nodes):
            ns = self.node_ns(i)
            self._ns_add(ns)
            for j in range(self.rails):
                port, dev = f"p{i}r{j}", self.ifname(j)
                # created inside the switch namespace, node end moved straight into the node
                # namespace: the host namespace never sees these links
                _run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns])
                _run(["ip", "-n", sw, "link", "set", port, "master", f"br{j}", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i, j)}/24", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                self._shape(ns, dev, with_delay=True)  # node -> switch: uplink (+ one-way delay)
                self._shape(sw, port, with_delay=False)  # switch -> node: downlink
        print(f"[emulate] {self.describe()}", file=self.log)

    def teardown(self) -> None:
        for ns in reversed(self._created):
            delete_namespace(ns)
        self._created.clear()

    def describe(self) -> str:
        d = f", one-way delay {self.delay}" if self.delay_applied else (
            f", delay {self.delay} NOT applied (no netem)" if self.delay_s > 0 else "")
        return (f"{self.nodes} nodes x {self.ranks_per_node} ranks, topology {self.topology} "
                f"({self.rails} link(s)/node at {self.rate}{d}), namespaces {self.prefix}-*")

    # ---- running things inside -----------------------------------------------------------
    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.node_ns(node), *argv]

    def tx_bytes(self, node: int, rail: int = 0) -> int:
        """Bytes the node has sent on ``rail`` (kernel counter of the node-side veth)."""
        out = _run(["ip", "-n", self.node_ns(node), "-s", "-j", "link", "show", "dev", self.ifname(rail)]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def all_tx_bytes(self) -> dict[tuple[int, int], int]:
        return {(i, j): self.tx_bytes(i, j) for i in range(self.nodes) for j in range(self.rails)}


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
        return argv + ["-m", "tools.emulate", "--rank-shim", *target]
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
               PYTHONUNBUFFERED="1")
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


def _rank_shim(argv: list[str]) -> None:
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
        _rank_shim(argv[1:])
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


if __name__ == "__main__":
    sys.exit(main())
