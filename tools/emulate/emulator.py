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

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
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


def tbf_args(rate: str) -> list[str]:
    """The tbf qdisc of a link at ``rate``. Bucket: >= 2 ms of traffic and >= one 64 KiB GSO
    segment, so tbf does not split TSO packets into MTU pieces (CPU) nor under-run at high rates;
    queue: 100 ms of traffic."""
    rate_Bps = parse_rate(rate) / 8
    burst = int(max(64 * 1024, rate_Bps * 0.002))
    limit = int(max(4 * burst, rate_Bps * 0.1))
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]


#: the rate ``set_link_rate`` gives an "unshaped" link: far above what 2 cores can send over a veth
UNSHAPED = "100gbit"


def set_link_rate(rate: str, shaped: list[list[str]] | None = None) -> None:
    """Every shaped link of this run to ``rate`` (``UNSHAPED``: the compute-side limit of a
    benchmark, measured in the same run) and back. From a worker: the links come from
    ``PARO_EMU_SHAPED`` in its environment (``launch`` sets it); root only."""
    if shaped is None:
        shaped = json.loads(os.environ.get("PARO_EMU_SHAPED", "[]"))
    if not shaped:
        raise EmulatorError("no shaped links to change: run under tools.emulate (PARO_EMU_SHAPED is unset)")
    tbf = tbf_args(rate)
    for ns, dev, handle in shaped:
        _run(["tc", "-n", ns, "qdisc", "change", "dev", dev, *handle.split(), *tbf])


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
    shaped: list[list[str]] = field(default_factory=list, init=False)  # [namespace, device, tc handle] per tbf
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
        tbf = tbf_args(self.rate)
        if with_delay and self.delay_s > 0:
            res = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", self.delay, "limit", "100000"], check=False)
            if res.returncode == 0:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
                self.delay_applied = True
                self.shaped.append([ns, dev, "parent 1:1 handle 10:"])
                return
            msg = (f"cannot add delay: the kernel has no netem qdisc ({res.stderr.strip()}); "
                   f"links are rate-limited only")
            if self.require_delay:
                raise EmulatorError(msg)
            if not getattr(self, "_warned_delay", False):
                print(f"[emulate] WARNING: {msg}", file=self.log)
                self._warned_delay = True
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
        self.shaped.append([ns, dev, "root handle 1:"])

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
