"""The peers: the systems users would run instead of PaRO, in their own released code (each pinned to a release),
as baselines of ``python -m tools.bench`` (``--baselines ds-zero3,mfsdp-hsdp,...``).

    python -m tools.bench.peers setup            # one virtual environment per pinned release
    python -m tools.bench.peers list             # the peers, their venvs and the patches
    python -m tools.bench.peers run --peers ds-zero3,mfsdp-hsdp --steps 3   # correctness runs
    python -m tools.bench --strategies III,IIG --baselines fsdp2-hsdp,mfsdp-hsdp,ds-mics  # timed

  __init__.py   the registry (this file): peers, releases, venvs, the missing-venv error
  setup.py      builds ``.venv-peers/<release>`` (torch pinned first, then the peer, no build isolation)
  patches.py    every stand-in / patch a peer needs here, beside its reason, each switchable
  worker.py     one rank of a peer run (in the peer's venv, under torchrun): the bench model, data,
                AdamW, A; the bench's timing; model-state memory; the one-process check
  deepspeed_peer.py / mfsdp_peer.py   how each system is configured and stepped
  driver.py     starts the workers on the emulated cluster (``headline.py``'s hook and ``run``)

Why separate venvs: each release pins its own world (MiCS exists only up to DeepSpeed 0.19.6
and deadlocks there, so it runs on 0.19.0); our ``.venv`` keeps PaRO's. Each venv gets the same
torch as ``.venv``. A peer runs in its own launch (one process per rank in the peer's venv), so
its rows are timed in rounds of their own, not interleaved with PaRO's.

Nothing here imports torch: ``headline.py`` imports this registry to split and check baselines.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

#: the repository root (the peers' venvs live under it, git-ignored)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VENV_DIR = os.path.join(ROOT, ".venv-peers")
SETUP_CMD = "python -m tools.bench.peers setup"
#: the torch every venv gets, the same as .venv's (pinned before anything else so pip never swaps it)
TORCH_PIN = "torch==2.13.0"


@dataclass(frozen=True)
class Release:
    """One pinned release in one venv."""
    venv: str  # folder under .venv-peers/
    pins: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # build environment
    why: str = ""


RELEASES = {
    "ds-0.19.8": Release("ds-0.19.8", ("deepspeed==0.19.8",), (("DS_BUILD_OPS", "0"),),
                         "DeepSpeed ZeRO-3 and ZeRO++ (hpZ, qwZ, qgZ) as released"),
    "ds-0.19.0": Release("ds-0.19.0", ("deepspeed==0.19.0",), (("DS_BUILD_OPS", "0"),),
                         "MiCS: removed in 0.19.7, its flat layout deadlocks on 0.19.6"),
    "mfsdp-0.6.1": Release("mfsdp-0.6.1", ("megatron-fsdp==0.6.1", "numpy"), (),
                           "Megatron-FSDP ZeRO-3, HSDP, HFSDP"),
}


@dataclass(frozen=True)
class Peer:
    name: str  # the --baselines value
    release: str  # key of RELEASES
    system: str  # "deepspeed" or "mfsdp"
    mode: str  # the system's own name of the layout
    label: str  # the table's row label
    approximate: bool = False  # runs through an approximate stand-in: losses differ by design


PEERS = {p.name: p for p in (
    Peer("ds-zero3", "ds-0.19.8", "deepspeed", "zero3", "DeepSpeed ZeRO-3"),
    Peer("ds-hpz", "ds-0.19.8", "deepspeed", "hpz", "DeepSpeed ZeRO++ hpZ"),
    Peer("ds-zeropp", "ds-0.19.8", "deepspeed", "zeropp", "DeepSpeed ZeRO++ hpZ+qwZ+qgZ ~", approximate=True),
    Peer("ds-mics", "ds-0.19.0", "deepspeed", "mics", "DeepSpeed 0.19.0 MiCS"),
    Peer("mfsdp-zero3", "mfsdp-0.6.1", "mfsdp", "zero3", "Megatron-FSDP ZeRO-3"),
    Peer("mfsdp-hsdp", "mfsdp-0.6.1", "mfsdp", "hsdp", "Megatron-FSDP HSDP"),
    Peer("mfsdp-hfsdp", "mfsdp-0.6.1", "mfsdp", "hfsdp", "Megatron-FSDP HFSDP"),
)}

#: the table labels of the peers' rows (headline_report's labels of the torch baselines, extended)
LABELS = {p.name: p.label for p in PEERS.values()}


class MissingVenv(RuntimeError):
    pass


def venv_path(release: str) -> str:
    return os.path.join(VENV_DIR, RELEASES[release].venv)


def venv_python(release: str) -> str:
    return os.path.join(venv_path(release), "bin", "python")


def missing_venv_line(peer: str) -> str:
    """The one line a run without the peer's venv fails with."""
    rel = PEERS[peer].release
    return (f"peer {peer} needs its venv {os.path.relpath(venv_path(rel), ROOT)} ({', '.join(RELEASES[rel].pins)}), "
            f"which is missing: run `{SETUP_CMD}` (or `{SETUP_CMD} --only {rel}`)")


def split_baselines(names: list[str]) -> tuple[list[str], list[str]]:
    """(the torch baselines, the peers) of a --baselines list, in order."""
    return [n for n in names if n not in PEERS], [n for n in names if n in PEERS]


def check_peers(names: list[str]) -> None:
    """Raise MissingVenv with the one-line error for the first peer whose venv is not built."""
    for n in names:
        if not os.path.exists(venv_python(PEERS[n].release)):
            raise MissingVenv(missing_venv_line(n))
