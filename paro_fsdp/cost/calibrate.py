"""Calibration: measure this process's mesh and return the :class:`Cluster` the cost model reads.

In the package: ``strategy="auto"`` without a cluster file calibrates at start-up. Collectives are
fitted with the alpha-beta ring model the time model prices, so what is measured is what is predicted.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .. import _compat
from ..collectives import KINDS, Kind, hops, ring_bytes
from ..dtypes import dtype_of
from ..models.llama import Llama, LlamaArgs, TransformerBlock, flavor, rope_tables
from .cluster import GB, Cluster, GiB, Link
from .model import flops_per_token, model_spec

__all__ = ["calibrate_in_process", "fit_alpha_beta"]

# Up to this size the whole model's forward + backward is timed for the compute rate, else one block's:
# a small model's step is dominated by what a block's FLOPs do not see (the loss over the vocabulary,
# each op's fixed cost); a large one's by its blocks' matmuls, and it may not fit unsharded.
WHOLE_MODEL_PARAMS = 50_000_000


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Fit time = a + bytes / bw, least squares in *relative* error (the small messages set the
    latency, the large ones the bandwidth); returns (bw in bytes/s, a in s), a >= 0, bw > 0."""
    pts = [(x, y) for x, y in points if y > 0]
    if not pts:
        raise ValueError("no positive timings to fit")
    if len(pts) == 1 or max(x for x, _ in pts) == min(x for x, _ in pts):
        x, y = max(pts)
        return x / y, 0.0
    # minimise sum(((a + s x) / y - 1)^2): normal equations in (a, s) with u = 1/y, v = x/y, in plain
    # floats: every rank gets the same bits (torch.linalg.lstsq differs in the last ones between ranks)
    suu, svv = sum(1 / y**2 for _, y in pts), sum((x / y) ** 2 for x, y in pts)
    suv, su, sv = sum(x / y**2 for x, y in pts), sum(1 / y for _, y in pts), sum(x / y for x, y in pts)
    det = suu * svv - suv**2
    a, slope = (su * svv - sv * suv) / det, (suu * sv - suv * su) / det
    if slope <= 0:  # noise dominates: the largest message's throughput, the smallest's time
        return max(pts)[0] / max(pts)[1], min(pts)[1]
    if a < 0:  # no measurable latency: a line through the origin, relative least squares
        return sum((x / y) ** 2 for x, y in pts) / sum(x / y for x, y in pts), 0.0
    return 1.0 / slope, a


def calibrate_in_process(mesh: Any, model_args: Optional[Union[str, LlamaArgs]] = None, micro_batch: int = 1,
                         seq_len: int = 128, dtype: str = "bf16", sizes_mib: Optional[Sequence[float]] = None,
                         reps: int = 3, name: str = "calibrated") -> Cluster:
    """Measure this mesh (what: ``tools/calibrate.py``). Collective. Each timing is the fastest call
    of the slowest rank; ``gpus_per_node`` is the intra size, so intra maps to the ``intra`` link."""
    groups = {d: mesh.get_group(d) for d in ("intra", "inter")}
    sizes = {d: dist.get_world_size(grp) for d, grp in groups.items()}
    m, g = sizes["intra"], sizes["inter"]
    device = mesh.device_type
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    tdtype = dtype_of(dtype)
    if sizes_mib is None:
        sizes_mib = (0.0625, 1, 8, 64) if device == "cuda" else (0.0625, 0.5, 2, 8)

    def seconds(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def timed(fn, r: int) -> float:
        """The fastest of ``r`` timed calls after a warm-up: the least disturbed on a shared machine."""
        seconds(fn)
        return min(seconds(fn) for _ in range(r))

    def together(fn, r: int) -> float:
        """The median of ``r`` calls, every rank starting each at once, as in training: on a shared host
        the fastest call of drifting ranks is one run while others wait (2x apart between calibrations)."""
        seconds(fn)
        samples = []
        for _ in range(r):
            dist.barrier()
            samples.append(seconds(fn))
        return statistics.median(samples)

    def slowest(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def numel(mib: float, k: int) -> int:
        return max(k, int(mib * 2**20 / 4) // k * k)  # fp32 elements, divisible by k

    def collective(kind: str, d: str, mib: float) -> Callable[..., Any]:
        k, grp = sizes[d], groups[d]
        full = torch.ones(numel(mib, k), device=dev)
        shard = torch.ones(full.numel() // k, device=dev)
        if kind == Kind.ALL_GATHER:
            return lambda async_op=False: _compat.all_gather_single(full, shard, group=grp, async_op=async_op)
        if kind == Kind.REDUCE_SCATTER:
            return lambda: _compat.reduce_scatter_single(shard, full, group=grp)
        return lambda: dist.all_reduce(full, group=grp)

    measured: dict[str, Any] = {"ranks": m * g, "intra_size": m, "inter_size": g, "backend": dist.get_backend(),
                                "device": device, "sizes_mib": list(sizes_mib)}
    links: dict[str, Link] = {}
    for d in (d for d in ("intra", "inter") if sizes[d] > 1):
        k, per_kind = sizes[d], {}
        for kind in KINDS:
            raw = []
            for mib in sizes_mib:
                fn = collective(kind, d, mib)
                dist.barrier()
                raw.append(timed(fn, reps))
            times = slowest(raw)
            ring = [ring_bytes(kind, numel(mib, k) * 4, k) for mib in sizes_mib]
            bw, a = fit_alpha_beta(list(zip(ring, times)))
            per_kind[kind] = (bw / GB, a / hops(kind, k) * 1e6)
            measured[f"{d}_{kind}_seconds"] = [round(t, 7) for t in times]
        base = per_kind[Kind.ALL_GATHER]
        links[d] = Link(*base, {kd: v for kd, v in per_kind.items() if v != base})
    for d, other in (("intra", "inter"), ("inter", "intra")):
        measured[f"{d}_link"] = "measured" if d in links else (f"copied from {other}" if other in links else
                                                                "not measured (one rank): placeholder")
    # one dimension measured: the other copies it; none (a single rank): communication is free
    links.setdefault("intra", links.get("inter", Link(1e3, 0.0)))
    links.setdefault("inter", links["intra"])

    # matmul FLOP/s, all ranks at once (they share the machine in training too)
    nmm = 4096 if device == "cuda" else 512
    a_ = torch.randn(nmm, nmm, device=dev, dtype=tdtype)
    b_ = torch.randn(nmm, nmm, device=dev, dtype=tdtype)
    t_mm = together(lambda: a_ @ b_, max(reps, 5))
    # a transformer block's forward + backward at the model's shape
    args = flavor(model_args) if isinstance(model_args, str) else (model_args or LlamaArgs(
        dim=256, n_layers=1, n_heads=4, ffn_dim=704, vocab_size=1024, max_seq_len=seq_len))
    torch.manual_seed(0)
    block = TransformerBlock(args).to(device=dev, dtype=tdtype)
    x = torch.randn(micro_batch, seq_len, args.dim, device=dev, dtype=tdtype, requires_grad=True)
    cos, sin = (t.to(dev) for t in rope_tables(args.dim // args.n_heads, seq_len, args.rope_theta))
    t_block = together(lambda: block(x, cos, sin).float().sum().backward(), max(reps, 7))
    spec1 = replace(model_spec(replace(args, n_layers=1)), vocab_size=0)
    f_fwd, f_bwd = flops_per_token(replace(spec1, trainable_layers=1), seq_len, False)
    block_flops = (f_fwd + f_bwd) * micro_batch * seq_len
    t_model = model_flops = None
    if model_args is not None and args.num_params() <= WHOLE_MODEL_PARAMS:
        whole = Llama(args).to(device=dev, dtype=tdtype)
        tokens = torch.randint(0, args.vocab_size, (micro_batch, seq_len + 1), device=dev)
        t_model = together(lambda: whole(tokens).loss.backward(), max(reps, 7))
        model_flops = sum(flops_per_token(model_spec(args), seq_len, False)) * micro_batch * seq_len
        del whole
    # memory bandwidth: y += x reads 2 and writes 1 buffer
    nbw = (64 if device == "cuda" else 16) * 2**20
    xb, yb = torch.ones(nbw, device=dev), torch.ones(nbw, device=dev)
    t_bw = together(lambda: yb.add_(xb), max(reps, 5))
    def overlap_on(d: str, rounds: int) -> float:
        """How much of a collective on ``d`` issued async hides behind matmuls of the same length."""
        comm = collective(Kind.ALL_GATHER, d, sizes_mib[-1])
        n_mm = max(1, int(round(timed(comm, reps) / max(t_mm, 1e-9))))
        comp = lambda: [a_ @ b_ for _ in range(n_mm)]  # noqa: E731

        def both() -> None:
            work = comm(async_op=True)
            comp()
            work.wait()

        # interleaved rounds and medians: the three figures must come from the same conditions
        samples: dict[str, list[float]] = {"comm": [], "comp": [], "both": []}
        for _ in range(rounds):
            for key, fn in (("comm", comm), ("comp", comp), ("both", both)):
                dist.barrier()
                samples[key].append(seconds(fn))
        t_comm, t_comp, t_both = slowest([statistics.median(samples[k]) for k in ("comm", "comp", "both")])
        return min(1.0, max(0.0, (t_comm + t_comp - t_both) / max(min(t_comm, t_comp), 1e-12)))

    # overlap per dimension: the widest one's is the cluster's, the intra one's apart where both exist
    d_ov = "inter" if g > 1 else ("intra" if m > 1 else None)
    overlap = overlap_on(d_ov, max(reps, 5)) if d_ov is not None else 0.0
    # the intra collective is short, its overlap noisier (0-0.3 between runs on 2 shared cores): more rounds
    intra_overlap = overlap_on("intra", max(reps, 15)) if g > 1 and m > 1 else None
    t_mm, t_block, t_bw, t_model = slowest([t_mm, t_block, t_bw, t_model or 0.0])
    # the whole model's rate where it was timed: the root, the loss and each op's fixed cost counted
    tflops = model_flops / t_model / 1e12 if model_flops else block_flops / t_block / 1e12
    if device == "cuda":
        mem_gib = torch.cuda.get_device_properties(dev).total_memory / GiB
    else:  # this host's memory shared by its ranks
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 16 * GiB
        mem_gib = total / GiB / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", m * g)))
    measured.update(matmul_n=nmm, block_dim=args.dim, block_seq=seq_len, block_micro_batch=micro_batch,
                    block_seconds=round(t_block, 6), overlap_dim=d_ov or "-",
                    **({"model_seconds": round(t_model, 6)} if model_flops else {}))
    return Cluster(name=name, gpus_per_node=m, memory_gib=round(mem_gib, 3), achieved_tflops=tflops,
                   memory_bandwidth_gbs=3 * nbw * 4 / t_bw / GB, intra=links["intra"], inter=links["inter"],
                   overlap=round(overlap, 3), intra_overlap=None if intra_overlap is None else round(intra_overlap, 3),
                   usable_memory_fraction=0.9, source="tools.calibrate",
                   description=f"measured by tools.calibrate on {m * g} ranks ({g} groups x {m}), "
                               f"{dist.get_backend()} on {device}",
                   measured={**measured, "matmul_tflops": 2 * nmm**3 / t_mm / 1e12})
