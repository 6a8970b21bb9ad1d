"""``python -m tools.bench.peers``: setup | list | run (``__init__.py`` says what each is)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import PEERS, RELEASES, MissingVenv, check_peers, venv_python
from .patches import CONFIG_NOTES, PATCHES


def _list() -> int:
    for p in PEERS.values():
        state = "ready" if os.path.exists(venv_python(p.release)) else "venv missing"
        pats = [n for n, x in PATCHES.items() if p.name in x.peers]
        print(f"{p.name:<12} {p.label:<34} {', '.join(RELEASES[p.release].pins):<24} {state:<12} "
              f"patches: {', '.join(pats) or 'none'}{'  (approximate)' if p.approximate else ''}")
    print("\npatches (switch off with --no-patch NAME or PARO_PEERS_NO_PATCH=NAME):")
    for x in PATCHES.values():
        print(f"  {x.name}{' (approximate)' if x.approximate else ''} [{', '.join(x.peers)}]\n    why: {x.reason}\n"
              f"    what: {x.what}")
    print("\nconfig settings (not patches):")
    for k, v in CONFIG_NOTES.items():
        print(f"  {k}: {v}")
    return 0


def _run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.peers run",
                                 description="Short correctness runs of the peers against one process (the bench "
                                             "model, data and optimizer); on the emulated cluster (root) or, with "
                                             "--no-emulator, on plain local gloo ranks")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--accum", default="2")
    ap.add_argument("--no-emulator", action="store_true")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--inter-rate", default="1gbit")
    for flag, v in (("dim", 128), ("layers", 4), ("heads", 4), ("kv-heads", 2), ("ffn", 352), ("vocab", 1024),
                    ("seq", 128), ("batch", 2)):
        ap.add_argument(f"--{flag}", type=int, default=v)
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--max-norm", type=float, default=None, help="clipping (default the bench's 1.0; 0: none)")
    ap.add_argument("--no-patch", default="")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args(argv)
    peers = [p for p in a.peers.split(",") if p]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        ap.error(f"unknown peer(s) {','.join(bad)}; valid: {','.join(PEERS)}")
    try:
        check_peers(peers)
    except MissingVenv as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.warmup, a.rounds, a.steps_per_round, a.no_limit, a.model = 0, 1, a.steps, True, "llama"
    extra = ["--check-steps", str(a.steps), "--optimizer", a.optimizer]
    if a.max_norm is not None:
        extra += ["--max-norm", str(a.max_norm)]
    if a.no_patch:
        extra += ["--no-patch", a.no_patch]
    from .driver import run_local, run_on_emulator, summary

    if a.no_emulator:
        rows = run_local(peers, a, a.nodes * a.ranks_per_node, a.ranks_per_node, a.timeout, extra)
    else:
        from tools.emulate.emulator import Emulator, EmulatorError, check_privileges

        try:
            check_privileges()
        except EmulatorError as e:
            print(f"error: {e} (or use --no-emulator)", file=sys.stderr)
            return 2
        with Emulator(a.nodes, a.ranks_per_node, a.inter_rate, "1ms", "shared") as emu:
            rows = run_on_emulator(emu, peers, a, a.timeout, extra)
    print("\n" + summary(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    failed = [r for r in rows if r.get("error") or (r.get("check") or {}).get("ok") is False]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\n\n  setup [--only RELEASE,...] [--force]   build .venv-peers/<release>\n"
              "  list                                   peers, venvs, patches\n"
              "  run [--peers ...] [--steps 3] [--no-emulator] ...   correctness runs (run --help)")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "setup":
        ap = argparse.ArgumentParser(prog="python -m tools.bench.peers setup")
        ap.add_argument("--only", default="", help=f"releases ({','.join(RELEASES)}); default all")
        ap.add_argument("--force", action="store_true", help="delete and rebuild")
        a = ap.parse_args(rest)
        from .setup import setup

        return setup([x for x in a.only.split(",") if x] or None, a.force)
    if cmd == "list":
        return _list()
    if cmd == "run":
        return _run(rest)
    print(f"unknown command {cmd}; valid: setup, list, run", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
