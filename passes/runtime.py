"""Runtime estimates for inductor's own overlap scheduler, from our cost model, on any device.

Why: inductor's overlap scheduler (``aten_distributed_optimizations.enable_overlap_scheduling``)
estimates collectives from the GPU's NCCL bandwidth tables and compute by benchmarking on the
GPU; on CPU it fails ("0 active drivers", or importing triton for its fusion-region costs). It
accepts a ``custom_runtime_estimation(node, override_size)``: this one prices every node with the
advisor's cluster description (``paro_fsdp/cost/``: per-link ring bandwidth and latency, achieved FLOP/s, memory
bandwidth), so the scheduler runs on CPU and plans for the cluster the job is sized for. Times
are in milliseconds, as inductor's own estimates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from paro_fsdp._compat import route_roofline_estimate
from paro_fsdp.collectives import Dim, Kind, ring_bytes
from paro_fsdp.cost.cluster import Cluster, link_for, link_seconds, load_cluster
from paro_fsdp.mesh import MeshGroups

from .graph import COMPUTE, KIND_OF, GroupTable, group_size_of, group_table


def _numel_bytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _flops(node: fx.Node) -> float:
    vals = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
    out = node.meta.get("val")
    name = node.target.name().split("::")[-1].split(".")[0] if hasattr(node.target, "name") else ""
    if node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        a, b = vals[-2], vals[-1]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if name in ("_int_mm", "_scaled_mm"):
        a, b = vals[0], vals[1]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if node.target in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
        a, b = vals[-2], vals[-1]
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if isinstance(out, (tuple, list)):
        out = out[0]
    if name in ("convolution", "convolution_backward"):  # weight [C_out, C_in / groups, *kernel]
        backward = name == "convolution_backward"
        y, w = (vals[0], vals[2]) if backward else (out, vals[1])
        return (4.0 if backward else 2.0) * y.numel() * (w.numel() // w.shape[0])
    backward = name.endswith("_backward")
    q, k = (vals[1:3] if backward else vals[:2]) if len(vals) >= 3 else (None, None)
    if "attention" in name and isinstance(q, torch.Tensor) and q.dim() == 4:  # not varlen's packed [T, H, D]
        # q, k [B, H, S, D] for the _scaled_dot_product ops, [B, S, H, D] for the kernels below
        # them; 2 matmuls forward, 5 backward (which recomputes the scores)
        s_kv = k.shape[2 if name.startswith("_scaled_dot_product") else 1]
        return (10.0 if backward else 4.0) * q.numel() * s_kv
    return 2.0 * _numel_bytes(out)


@dataclass
class RuntimeEstimate:
    cluster: Cluster
    groups: GroupTable = field(default_factory=dict)  # a collective of a group not in it is priced as global

    def collective_ms(self, node: fx.Node, override_size: int | None = None) -> float:
        kind = KIND_OF[node.target]
        group = str(node.args[-1])
        dim = self.groups.get(group, (Dim.GLOBAL, None))[0]
        k = group_size_of(node, kind)
        if override_size is not None:
            nbytes = override_size
        elif kind == Kind.ALL_GATHER:
            nbytes = _numel_bytes(node.meta.get("val"))
        else:
            nbytes = _numel_bytes(node.args[0].meta.get("val"))  # type: ignore[union-attr]
        # one node at a time, without the mesh shape: the plain link of its dimension (global:
        # the slow links bound it), not the advisor's layout-aware choice
        link = link_for(dim, self.cluster)
        return link_seconds(link, kind, k, ring_bytes(kind, nbytes, k)) * 1e3

    def __call__(self, node: fx.Node, override_size: int | None = None) -> float | None:
        if node.op != "call_function":
            return 0.0
        if node.target in KIND_OF:
            return self.collective_ms(node, override_size)
        if node.target in COMPUTE:
            return _flops(node) / (self.cluster.achieved_tflops * 1e12) * 1e3
        moved = _numel_bytes(node.meta.get("val")) + sum(
            _numel_bytes(a.meta.get("val")) for a in node.args if isinstance(a, fx.Node))
        return moved / (self.cluster.memory_bandwidth_gbs * 1e9) * 1e3


def enable_overlap_scheduler(cluster: Cluster | str = "a100_ib",
                             meshes: tuple[MeshGroups, ...] = ()) -> RuntimeEstimate:
    """Turn on inductor's overlap scheduler with our estimates (``cluster``: a ``Cluster`` or a
    preset name / TOML path for ``paro_fsdp.cost.cluster.load_cluster``; ``meshes``: the
    compiled models' ``MeshGroups``, which say each collective's link)."""
    estimate = RuntimeEstimate(load_cluster(cluster) if not isinstance(cluster, Cluster) else cluster,
                               group_table(*meshes))
    cfg = torch._inductor.config.aten_distributed_optimizations
    cfg.enable_overlap_scheduling = True
    cfg.custom_runtime_estimation = estimate
    cfg.enable_fusion_regions = False  # its I/O correction asks the GPU for DRAM bandwidth too
    route_roofline_estimate(estimate)  # torch 2.13 asks its GPU roofline first (paro_fsdp/_compat.py)
    return estimate


def disable_overlap_scheduler() -> None:
    cfg = torch._inductor.config.aten_distributed_optimizations
    cfg.enable_overlap_scheduling = False
    cfg.custom_runtime_estimation = None
    cfg.enable_fusion_regions = True
    route_roofline_estimate(None)
