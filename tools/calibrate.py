"""Measure the real mesh and write a cluster file the advisor reads.

    torchrun --nproc-per-node 8 --nnodes 4 ... -m tools.calibrate --out my_cluster.toml
    python -m tools.calibrate --nproc 4 --group-size 2 --out cpu4.toml     # local gloo ranks on CPU
    python -m tools.advisor --cluster my_cluster.toml --model llama7b --gpus 64 ...

Why: the advisor's predictions are only as good as its bandwidths, latencies and FLOP/s, and
datasheet figures are optimistic (and say nothing about a particular fabric). This runs the
collectives PaRO uses on the mesh PaRO uses — all-gather, reduce-scatter and all-reduce over
the ``intra`` and the ``inter`` dimension of the (n/m, m) mesh, every group at once as in
training, at several buffer sizes — and fits time = (ring steps) x latency + ring bytes /
bandwidth per kind and dimension; it also times a matmul, one transformer block's forward +
backward at the model's shape (the achieved FLOP/s the advisor uses), memory bandwidth and how
well a collective overlaps compute. Any backend: NCCL on GPUs, gloo on CPU. Every rank takes
part; rank 0 writes the TOML (``[measured]`` keeps the raw timings).

The file describes *this* mesh: ``gpus_per_node`` = the group size, ``[intra]`` = the intra
dimension's links, ``[inter]`` = the inter dimension's, per GPU while all ranks communicate.
Calibrate with the group size you will train with (normally the GPUs per node) and at least
two groups, so that the inter links are measured (with one group, [inter] copies [intra]).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from paro_fsdp.cost.calibrate import calibrate_in_process
from paro_fsdp.cost.cluster import Cluster, cluster_to_toml
from paro_fsdp.dtypes import DTYPES, short_name
from paro_fsdp.models.llama import LlamaArgs, flavor
from tools.local_world import run_local_world


PROBE = dict(dim=256, n_layers=1, n_heads=4, ffn_dim=704, vocab_size=1024)


def _summary(c: Cluster) -> str:
    rows = [f"{c.description}",
            f"  achieved {c.achieved_tflops:.3g} TFLOP/s (transformer block fwd+bwd), matmul "
            f"{c.measured.get('matmul_tflops', float('nan')):.3g} TFLOP/s, memory {c.memory_bandwidth_gbs:.3g} GB/s, "
            f"overlap {c.overlap:.2f}, {c.memory_gib:.1f} GiB per rank"]
    for name, link in (("intra", c.intra), ("inter", c.inter)):
        kinds = ", ".join(f"{k} {bw:.3g} GB/s {lat:.3g} us" for k, (bw, lat) in sorted(link.per_kind.items()))
        how = c.measured.get(f"{name}_link", "measured")
        if how != "measured":
            rows.append(f"  {name}: {how}")
            continue
        rows.append(f"  {name}: all_gather {link.bandwidth_gbs:.3g} GB/s, {link.latency_us:.3g} us/step"
                    + (f"; {kinds}" if kinds else ""))
    return "\n".join(rows)


def run(args: argparse.Namespace) -> Optional[Cluster]:
    """Calibrate inside an initialised (or to be initialised) process group; rank 0 writes."""
    import torch
    import torch.distributed as dist

    from paro_fsdp.mesh import init_paro_mesh

    if not dist.is_initialized():
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group(backend, device_id=device)
        else:
            dist.init_process_group(backend)
    world = dist.get_world_size()
    m = args.group_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % m:
        raise SystemExit(f"calibrate: group size {m} does not divide the world size {world}")
    mesh = init_paro_mesh(m)
    if args.model:
        model_args = flavor(args.model)
    elif mesh.device_type == "cuda":
        model_args = flavor("llama7b")
    else:
        model_args = LlamaArgs(**PROBE, max_seq_len=args.seq_len)
    sizes = [float(x) for x in args.sizes_mib.split(",")] if args.sizes_mib else None
    cluster = calibrate_in_process(
        mesh,
        model_args,
        args.micro_batch,
        args.seq_len,
        short_name(args.dtype),
        sizes,
        args.reps,
        name=Path(args.out).stem if args.out else "calibrated",
    )
    if dist.get_rank() == 0:
        text = cluster_to_toml(
            cluster,
            [
                "Measured by python -m tools.calibrate; read by python -m tools.advisor --cluster THIS_FILE.",
                "bandwidth_gbs: ring bus bandwidth per rank (GB/s = 1e9 B/s) while every rank communicates;",
                "latency_us: per ring step; achieved_tflops: a transformer block's forward + backward at",
                f"dim {model_args.dim}, ffn {model_args.ffn_dim}, micro-batch {args.micro_batch} x seq "
                f"{args.seq_len}, {args.dtype}.",
            ],
        )
        if args.out:
            Path(args.out).write_text(text)
        print(_summary(cluster))
        print(f"wrote {args.out}" if args.out else text)
    return cluster


def _local_entry(argv: list[str]) -> Optional[Cluster]:
    return run(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="calibrated_cluster.toml", help="cluster TOML to write ('' prints it)")
    ap.add_argument("--group-size", type=int, default=None,
                    help="ranks per group m (default: LOCAL_WORLD_SIZE under torchrun, nproc/2 when spawning)")
    ap.add_argument("--nproc", type=int, default=4, help="without torchrun: local gloo ranks to spawn")
    ap.add_argument("--backend", default=None, help="nccl / gloo (default: nccl when GPUs are visible)")
    ap.add_argument(
        "--model",
        default=None,
        help="flavor whose block shape sets achieved_tflops (default: llama7b on GPU, a small probe on CPU)",
    )
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument(
        "--sizes-mib",
        default=None,
        help="buffer sizes, comma-separated MiB (default 0.0625,0.5,2,8 on CPU; up to 64 on GPU)",
    )
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per size (median)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        run(args)
        return 0
    if args.nproc < 1:
        raise SystemExit("calibrate: --nproc must be >= 1")
    if args.group_size is None and args.nproc >= 2 and args.nproc % 2 == 0:
        argv += ["--group-size", str(args.nproc // 2)]  # two groups: both mesh dimensions get measured
    run_local_world(args.nproc, "tools.calibrate:_local_entry", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
