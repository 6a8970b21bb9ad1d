"""What the passes read from a post-grad FX graph: the engine's collectives, their mesh dimension,
phase and block, and where they are issued and waited.

Why from metadata rather than from patterns: the engine issues every collective in a block's
pre-forward hook or in the backward of its unshard Function, so each collective node carries the
block's ``nn_module_stack``, and its process-group name says which mesh dimension it runs on
(a ``GroupTable`` of the compiled models' meshes, handed to ``ParoPasses``). A graph is a backward
graph when AOTAutograd gave it tangents.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.fx as fx

from paro_fsdp.collectives import Kind, ring_bytes
from paro_fsdp.mesh import MeshGroups

#: c10d group name -> (mesh dimension, the MeshGroups it belongs to): how a pass tells an intra
#: collective from an inter or global one, given only the group name in the graph
GroupTable = Mapping[str, tuple[str, MeshGroups]]


def group_table(*meshes: MeshGroups) -> dict[str, tuple[str, MeshGroups]]:
    """The table of the given meshes' groups (``model.paro_mesh_groups()`` of each compiled model)."""
    return {name: (dim, mesh) for mesh in meshes for dim, name in mesh.group_names.items()}


_ops = torch.ops._c10d_functional
KIND_OF = {
    _ops.all_gather_into_tensor.default: Kind.ALL_GATHER,
    _ops.all_gather_into_tensor_out.default: Kind.ALL_GATHER,  # what torch's bucketing emits
    _ops.reduce_scatter_tensor.default: Kind.REDUCE_SCATTER,
    _ops.all_reduce.default: Kind.ALL_REDUCE,
}
WAITS = {_ops.wait_tensor.default, torch.ops.c10d_functional.wait_tensor.default}
#: ops whose cost dwarfs the layout copies around collectives, forward and backward: what
#: "compute" means to the passes (anything else may move with a collective as a cheap copy).
#: By name, since the fused attention kernels differ between torch releases (2.11 to 2.14)
COMPUTE_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "_int_mm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm",
    "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_fused_attention_overrideable_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
    "_cudnn_attention_forward", "_cudnn_attention_backward",
)
COMPUTE = {getattr(torch.ops.aten, name).default for name in COMPUTE_OPS
           if hasattr(torch.ops.aten, name) and hasattr(getattr(torch.ops.aten, name), "default")}


@dataclass
class Collective:
    node: fx.Node  # the collective (issues it)
    wait: fx.Node  # its wait_tensor
    kind: Kind
    group: str
    dim: str  # a ``Dim`` (or "?" for a group paro_shard did not create)
    info: MeshGroups | None  # sizes and group names of its mesh (None: a group paro_shard did not create)
    block: tuple  # the module path of the block that issued it
    nbytes: int  # bytes of the whole buffer (all-gather output, reduce-scatter / all-reduce input)

    @property
    def ring_bytes(self) -> float:
        """Bytes one rank sends, by the spec's ring formula (as comm.CommStats counts them)."""
        return ring_bytes(self.kind, self.nbytes, self.group_size)

    @property
    def group_size(self) -> int:
        return group_size_of(self.node, self.kind)


def group_size_of(node: fx.Node, kind: str) -> int:
    """Ranks in a collective's group. all_gather_into_tensor(x, size, name) and
    reduce_scatter_tensor(x, op, size, name) carry it; all_reduce(x, op, name) only names its
    group, whose size c10d knows."""
    if kind == Kind.ALL_GATHER:
        return int(node.args[1])
    if kind == Kind.REDUCE_SCATTER:
        return int(node.args[2])
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(str(node.args[-1])).size()


def _val(node: fx.Node) -> torch.Tensor | None:
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def block_of(node: fx.Node) -> tuple:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return tuple(str(v[0]) if isinstance(v, tuple) else str(v) for v in stack.values())


def collectives(graph: fx.Graph, groups: GroupTable) -> list[Collective]:
    """Every collective with a single wait, in graph order; ``groups`` names their dimensions."""
    out = []
    for node in graph.nodes:
        kind = KIND_OF.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        waits = [u for u in node.users if u.target in WAITS]
        if len(waits) != 1 or len(node.users) != 1:
            continue
        group = str(node.args[-1])
        dim, info = groups.get(group, ("?", None))
        v = _val(waits[0]) if kind == Kind.ALL_GATHER else _val(node.args[0])  # type: ignore[arg-type]
        nbytes = v.numel() * v.element_size() if v is not None else 0
        out.append(Collective(node, waits[0], kind, group, dim, info, block_of(node), nbytes))
    return out


def phase_of(graph: fx.Graph) -> str:
    names = [n.name for n in graph.find_nodes(op="placeholder")]
    return "backward" if any(n.startswith("tangents") for n in names) else "forward"


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}
