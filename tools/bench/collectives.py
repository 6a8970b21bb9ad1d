"""PaRO-CC against the flat gloo collective over the flattened mesh, on the emulated cluster.

    # both topologies, 2 nodes x 2 ranks, 1 MiB .. 256 MiB (needs root: it builds the emulator)
    python -m tools.bench.collectives --nodes 2 --ranks-per-node 2 --inter-rate 200mbit
    python -m tools.bench.collectives --quick            # 1, 4, 16 MiB, 3 reps: ~2-3 min on 2 cores
    # one topology through the emulator CLI (this module is then the per-rank worker)
    python -m tools.emulate --topology rails -- -m tools.bench.collectives --sizes-mb 1,16

Why: spec section 4 claims the hierarchical rearrangement beats a flat ring by ~33-37 % on a
real cluster (paper v1/v2). This measures the same thing on our emulator: flat = one
``_c10d_functional`` collective over mesh["inter","intra"]._flatten() (what the engine issued as
"global" before PaRO-CC); paro = ``ParoCC`` (chunked, phases overlapped); paro1 = ``ParoCC``
with one chunk (the hierarchy without overlap, to show what chunking adds).

Message size S = the whole tensor: all-gather output, reduce-scatter input, all-reduce tensor.
Time = the slowest rank, from a barrier to the result; the table shows the median over reps
(after one warm-up), flat and paro interleaved per rep so machine noise hits both. busbw as in
nccl-tests: S / t * (n-1)/n for all-gather / reduce-scatter, * 2(n-1)/n for all-reduce.
ratio = t_flat / t_paro (> 1: PaRO-CC faster; the paper's +32.6 % is 1.33).
"inter MiB" = bytes node 0 sent on its link(s) per collective, from the kernel's tx_bytes
counters (per rail for rails): it shows where the traffic went, not only how long it took.
Caveat: gloo runs reduce_scatter_tensor as an all-reduce plus a slice (ENVIRONMENT.md), for the
flat and the hierarchical version alike, so reduce-scatter moves all-reduce bytes on both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from paro_fsdp.dtypes import DTYPES, dtype_of
from tools.emulate.emulator import Emulator, EmulatorError, check_privileges, local_tx_bytes
from tools.emulate.gloo_rs import install_from_env
from tools.emulate.launch import ResultTee, launch, worker_or_driver

#: the command line the driver starts on every emulated node (as ``--worker``)
CLI = "tools.bench.collectives"

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
VARIANTS = ("flat", "paro", "paro1")
RESULT_TAG = "BENCH_COLLECTIVES_JSON "


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench.collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-rate", default="200mbit")
    p.add_argument("--inter-delay", default="1ms")
    p.add_argument("--topologies", default="shared,rails")
    p.add_argument("--sizes-mb", default="1,4,16,64,256", help="message sizes in MiB, comma separated")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--chunk-mb", type=float, default=8.0, help="PaRO-CC target chunk size (of the whole message)")
    p.add_argument("--max-chunks", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="sizes 1,4,16 MiB and 3 reps")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes_mb, args.reps = "1,4,16", 3
    return args


# ---- the per-rank worker (under torchrun) --------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from paro_fsdp.comm import MeshComm
    from paro_fsdp.mesh import MeshInfo, init_paro_mesh
    from paro_fsdp.paro_cc import ParoCC

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    install_from_env()
    m = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks_per_node))
    info = MeshInfo.from_mesh(init_paro_mesh(m))
    n, rank = info.n, dist.get_rank()
    ops = torch.ops._c10d_functional
    gname = info.group_names["global"]
    dtype = dtype_of(args.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    comm = MeshComm(info.groups)
    cc = ParoCC(comm, chunk_bytes=int(args.chunk_mb * 2**20), max_chunks=args.max_chunks)
    cc1 = ParoCC(comm, max_chunks=1)
    # node 0's links (rank 0 lives there): every distinct interface the emulator gave its ranks
    ifnames = sorted(set(filter(None, os.environ.get("PARO_EMU_IFNAMES", "").split(","))))

    def run(kind: str, variant: str, x: torch.Tensor) -> torch.Tensor:
        if variant == "flat":
            if kind == "all_gather":
                return ops.wait_tensor(ops.all_gather_into_tensor(x, n, gname))
            if kind == "reduce_scatter":
                return ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", n, gname))
            return ops.wait_tensor(ops.all_reduce(x, "sum", gname))
        c = cc if variant == "paro" else cc1
        return getattr(c, kind)(x).wait()

    def timed(kind: str, variant: str, x: torch.Tensor) -> tuple[float, dict[str, int]]:
        # counters first, then the barrier: after it, node 0's other ranks may start sending
        # before rank 0 gets to read them (the previous collective is complete on every rank)
        before = local_tx_bytes(ifnames) if rank == 0 else {}
        dist.barrier()
        t0 = time.perf_counter()
        run(kind, variant, x)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # also: every rank is done sending
        after = local_tx_bytes(ifnames) if rank == 0 else {}
        return dt.item(), {k: after[k] - before[k] for k in after}

    variants = args.variants.split(",")
    rows = []
    for size_mb in [float(s) for s in args.sizes_mb.split(",")]:
        numel = int(size_mb * 2**20) // esize // n * n
        for kind in args.kinds.split(","):
            # all-gather input is the 1/n shard; the others take the whole message
            x = torch.randn(numel // n if kind == "all_gather" else numel).to(dtype)
            if kind == "all_gather":
                assert torch.equal(run(kind, "flat", x), run(kind, "paro", x))  # warm-up, and a sanity check
            else:
                for v in variants:
                    run(kind, v, x)
            times: dict[str, list[float]] = {v: [] for v in variants}
            sent: dict[str, list[dict[str, int]]] = {v: [] for v in variants}
            for rep in range(args.reps):
                order = variants if rep % 2 == 0 else variants[::-1]
                for v in order:
                    t, b = timed(kind, v, x)
                    times[v].append(t)
                    sent[v].append(b)
            nbytes = numel * esize
            factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n
            row = {"kind": kind, "size_mb": size_mb, "bytes": nbytes}
            for v in variants:
                t = statistics.median(times[v])
                row[v] = {
                    "t": t,
                    "busbw_gbps": nbytes * factor / t * 8 / 1e9,
                    "tx_mib": {
                        k: statistics.median(s[k] for s in sent[v]) / 2**20 for k in (sent[v][0] if sent[v] else {})
                    },
                }
            if "flat" in variants and "paro" in variants:
                row["ratio"] = row["flat"]["t"] / row["paro"]["t"]
            rows.append(row)
            if rank == 0:
                print(_format_row(row, variants), flush=True)
    if rank == 0:
        meta = {"topology": os.environ.get("PARO_EMU_TOPOLOGY", "none"), "rate": os.environ.get("PARO_EMU_RATE", "?"),
                "g": info.g, "m": info.m, "dtype": args.dtype, "reps": args.reps, "chunk_mb": args.chunk_mb,
                "max_chunks": args.max_chunks}
        print(RESULT_TAG + json.dumps({"meta": meta, "rows": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ---- formatting ---------------------------------------------------------------------------------
def _tx(row_v: dict) -> str:
    return "/".join(f"{v:.1f}" for _, v in sorted(row_v["tx_mib"].items())) or "-"


def _format_row(row: dict, variants: list[str], topology: str | None = None) -> str:
    cells = [f"{topology:>7}" if topology else "", f"{row['kind']:>14}", f"{row['size_mb']:>7g}"]
    for v in variants:
        r = row[v]
        cells.append(f"{r['t'] * 1e3:9.1f} {r['busbw_gbps']:7.3f} {_tx(r):>11}")
    if "ratio" in row:
        cells.append(f"{row['ratio']:6.2f}")
    return " ".join(c for c in cells if c)


def _header(variants: list[str], with_topology: bool) -> str:
    cells = (["topo".rjust(7)] if with_topology else []) + ["collective".rjust(14), "MiB".rjust(7)]
    for v in variants:
        cells.append(f"{(v + ' ms'):>9} {'busbw':>7} {'inter MiB':>11}")
    if "flat" in variants and "paro" in variants:
        cells.append(" ratio")
    return " ".join(cells)


# ---- the driver (root): builds the emulator per topology and runs the workers -------------------
def driver(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        check_privileges()
    except EmulatorError as e:
        print(f"[bench_collectives] error: {e}", file=sys.stderr)
        return 2
    # the worker gets the same arguments (minus --quick, already expanded)
    worker_args = ["--sizes-mb", args.sizes_mb, "--kinds", args.kinds, "--variants", args.variants, "--reps",
                   str(args.reps), "--dtype", args.dtype, "--chunk-mb", str(args.chunk_mb), "--max-chunks",
                   str(args.max_chunks), "--ranks-per-node", str(args.ranks_per_node)]
    results = []
    for topology in args.topologies.split(","):
        print(
            f"\n== topology {topology}: {args.nodes} nodes x {args.ranks_per_node} ranks, {args.inter_rate}", flush=True
        )
        print(_header(args.variants.split(","), False), flush=True)
        tee = ResultTee(RESULT_TAG)
        with Emulator(args.nodes, args.ranks_per_node, args.inter_rate, args.inter_delay, topology) as emu:
            rc = launch(emu, ["-m", CLI, "--worker", *worker_args], timeout=args.timeout,
                        out=tee)  # type: ignore[arg-type]
        if rc != 0:
            print(f"[bench_collectives] topology {topology}: run failed ({rc})", file=sys.stderr)
            return rc
        results += [json.loads(payload) for payload in tee.tagged()]
    variants = args.variants.split(",")
    print(f"\n== PaRO-CC vs flat gloo collective ({args.nodes} nodes x {args.ranks_per_node} ranks, "
          f"{args.inter_rate}, {args.dtype}; ms = median of {args.reps}; busbw in Gbit/s; ratio = flat / paro)")
    print(_header(variants, True))
    for res in results:
        for row in res["rows"]:
            print(_format_row(row, variants, res["meta"]["topology"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    return worker_or_driver(argv, _args, worker, driver)


if __name__ == "__main__":
    sys.exit(main())
