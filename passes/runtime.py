"""Runtime estimates for inductor's own overlap scheduler, from our cost model, on any device.

Why: inductor's overlap scheduler (``aten_distributed_optimizations.enable_overlap_scheduling``)
estimates collectives from the GPU's NCCL bandwidth tables and compute by benchmarking on the
GPU; on CPU it fails ("0 active drivers", or importing triton for its fusion-region costs). It accepts a ``custom_runtime_estimation(node,
override_size)``: this one prices every node with the advisor's cluster description
(``paro_fsdp/cost/``: per-link ring bandwidth and latency, achieved FLOP/s, memory
bandwidth), so the scheduler runs on CPU and plans for the cluster the job is sized for. Times
are in milliseconds, as inductor's own estimates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from paro_fsdp._compat import route_roofline_estimate
from paro_fsdp.collectives import ring_bytes
from paro_fsdp.cost.cluster import Cluster, link_for, link_seconds, load_cluster
from paro_fsdp.mesh import MeshGroups

from .graph import COMPUTE, KIND_OF, GroupTable, group_size_of, group_table


def _numel_bytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _flops(node: fx.Node) -> float:
    vals = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
    out = node.meta.get("val")
    if node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        a, b = vals[-2], vals[-1]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if node.target in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
        a, b = vals[-2], vals[-1]
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if isinstance(out, (tuple, list)):
        out = out[0]
    q = vals[0] if vals else None
    if isinstance(q, torch.Tensor) and q.dim() == 4:  # attention: q [B, H, S, D]
        b, h, s, d = q.shape
        return 4.0 * b * h * s * s * d
    return 2.0 * _numel_bytes(out)


@dataclass
class RuntimeEstimate:
    cluster: Cluster
    groups: GroupTable = field(default_factory=dict)  # a collective of a group not in it is priced as global

    def collective_ms(self, node: fx.Node, override_size: int | None = None) -> float:
        kind = KIND_OF[node.target]
        group = str(node.args[-1])
        dim = self.groups.get(group, ("global", None))[0]
        k = group_size_of(node, kind)
        if override_size is not None:
            nbytes = override_size
        elif kind == "all_gather":
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


def enable_overlap_scheduler(cluster: Cluster | str = "a100_ib", meshes: tuple[MeshGroups, ...] = ()) -> RuntimeEstimate:
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
