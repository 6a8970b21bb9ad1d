"""Starting the peers' workers: on an emulated cluster already built (``headline.py``'s hook, one
launch per peer with the torchrun of the peer's venv) or on plain gloo ranks of this machine
(``--no-emulator``: a correctness run without root). Returns the rows the workers report, in
``headline_worker``'s row format (plus ``check``, ``patches``, ``approximate``, ``peer``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from typing import Any

from . import PEERS, ROOT, MissingVenv, check_peers, split_baselines, venv_path
from .worker import RESULT_TAG

#: the worker flags a bench run passes on (the model, A and the timing rounds)
MODEL_FLAGS = ("dim", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "model", "accum", "warmup",
               "rounds", "steps_per_round")


def worker_argv(peer: str, args: argparse.Namespace, extra: list[str] | None = None) -> list[str]:
    argv = ["-m", "tools.bench.peers.worker", "--peer", peer]
    for k in MODEL_FLAGS:
        v = getattr(args, k, None)
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    if getattr(args, "no_limit", False):
        argv.append("--no-limit")
    return argv + list(extra or [])


def unsupported(args: argparse.Namespace) -> str | None:
    """Why a bench run's settings cannot run on the peers (they train fp32, all weights), or None."""
    if getattr(args, "dtype", "fp32") != "fp32" or getattr(args, "trainable", 1.0) != 1.0 \
            or getattr(args, "lora_rank", 0) or getattr(args, "compiled", False):
        return "the peers run fp32 full training only (no --dtype bf16, --trainable, --lora-rank, --compiled)"
    return None


def _rows(peer: str, accums: list[int], tee_text: str, rc: int) -> list[dict[str, Any]]:
    for line in tee_text.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    err = f"worker failed (exit {rc}); see the log above"
    return [{"name": peer, "kind": "baseline", "accum": a, "error": err, "state_bytes": 0.0} for a in accums]


def run_on_emulator(emu: Any, peers: list[str], args: argparse.Namespace, timeout: float | None = None,
                    extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Each peer in turn on ``emu`` (a set-up ``tools.emulate`` Emulator); its rows."""
    from tools.emulate.launch import ResultTee, launch

    check_peers(peers)
    rows: list[dict[str, Any]] = []
    accums = [int(a) for a in str(args.accum).split(",")]
    for p in peers:
        print(f"\n== peer {p} ({PEERS[p].label}, {PEERS[p].release}) on the emulated cluster", flush=True)
        tee = ResultTee(RESULT_TAG)
        torchrun = os.path.join(venv_path(PEERS[p].release), "bin", "torchrun")
        rc = launch(emu, worker_argv(p, args, extra), torchrun=torchrun, timeout=timeout, out=tee)  # type: ignore[arg-type]
        rows += _rows(p, accums, bytes(tee.buf).decode(errors="replace"), rc)
    return rows


def run_local(peers: list[str], args: argparse.Namespace, nproc: int, m: int, timeout: float | None = None,
              extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Each peer in turn on ``nproc`` plain gloo ranks of this machine (no shaped links)."""
    check_peers(peers)
    rows: list[dict[str, Any]] = []
    accums = [int(a) for a in str(args.accum).split(",")]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    env.pop("PARO_EMU_IFNAMES", None)
    for p in peers:
        torchrun = os.path.join(venv_path(PEERS[p].release), "bin", "torchrun")
        argv = [torchrun, "--standalone", "--nproc-per-node", str(nproc), "--local-ranks-filter", "0",
                *worker_argv(p, args, ["--ranks-per-node", str(m), *(extra or [])])]
        print(f"\n== peer {p} ({PEERS[p].label}, {PEERS[p].release}) on {nproc} local gloo ranks", flush=True)
        proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout)
        text = proc.stdout.decode(errors="replace")
        for line in text.splitlines():
            if line.startswith(("[peers]", "[rank0]")) or "Error" in line:
                print(line, flush=True)
        rows += _rows(p, accums, text, proc.returncode)
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per peer and A: step, state, the check's verdict."""
    out = []
    for r in rows:
        label = PEERS[r["name"]].label if r["name"] in PEERS else r["name"]
        if r.get("error"):
            out.append(f"{label:<34} A={r['accum']} failed: {r['error']}")
            continue
        c = r.get("check") or {}
        chk = "not checked" if "ok" not in c else (
            f"check {'ok' if c['ok'] else 'FAILED'} ({c['max_abs_diff']:.2g} over {c['steps']} steps"
            f"{', approximate' if r.get('approximate') else ''})")
        out.append(f"{label:<34} A={r['accum']} step {r['step_s']:.3f} s  state {r['state_bytes'] / 2**20:6.2f} "
                   f"MiB/rank  {chk}")
    return "\n".join(out)


def merge_into_report(rows: list[dict[str, Any]]) -> None:
    """Mark the peers' rows for ``headline_report`` (its label table gets the peers' labels; a
    failing or approximate check shows in the label)."""
    from tools.bench.headline_report import BASELINE_LABEL

    for r in rows:
        if r["name"] not in PEERS:
            continue
        c = r.get("check") or {}
        mark = " ~" if r.get("approximate") and not PEERS[r["name"]].approximate else ""
        if c.get("ok") is False:
            mark += " CHECK FAILED"
        BASELINE_LABEL[r["name"] + mark] = PEERS[r["name"]].label + mark
        r["peer_name"], r["name"] = r["name"], r["name"] + mark


# ---- the hook in headline.py (python -m tools.bench --baselines ...,ds-zero3,...) ----------------------
def bench_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Move the peers out of ``args.baselines`` into ``args.peers`` (the worker builds the torch
    baselines only); exit with one line if a peer cannot run: its venv missing, or settings the
    peers do not take."""
    names = [b for b in str(args.baselines or "").split(",") if b]
    torch_ones, peers = split_baselines(names)
    args.peers = peers
    if not peers:
        return
    args.baselines = ",".join(torch_ones)
    why = unsupported(args)
    try:
        if why:
            raise MissingVenv(why)
        check_peers(peers)
    except MissingVenv as e:
        parser.exit(2, f"error: {e}\n")


def bench_run(emu: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The peers of ``args.peers`` on the bench's emulated cluster, after PaRO's run."""
    if not getattr(args, "peers", None):
        return []
    extra = list(filter(None, [f"--no-patch={os.environ['PARO_PEERS_NO_PATCH']}"
                               if os.environ.get("PARO_PEERS_NO_PATCH") else ""]))
    return run_on_emulator(emu, args.peers, args, args.timeout, extra)


def bench_merge(res: dict[str, Any], peer_rows: list[dict[str, Any]], budget_mib: float | None) -> None:
    """Add the peers' rows to the bench's result and print the table again with them."""
    if not peer_rows:
        return
    from tools.bench.headline_report import format_report

    print("\n" + summary(peer_rows))
    merge_into_report(peer_rows)
    res["rows"] += peer_rows
    print("\n== with the peers (each timed in its own launch, after PaRO's interleaved rounds)")
    print(format_report(res["rows"], res["meta"], budget_mib), flush=True)
