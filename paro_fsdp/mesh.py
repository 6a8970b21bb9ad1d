"""The 2D device mesh ("inter", "intra") and this rank's place in it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch._subclasses.fake_tensor import unset_fake_temporarily

MESH_DIMS = ("inter", "intra")


def device_type_for_backend(backend: str) -> str:
    """The device a process group's collectives run on: "cuda" when NCCL serves CUDA tensors
    ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl"), else "cpu" ("gloo", "fake", "cpu:gloo")."""
    parts = [p.strip().lower().rpartition(":") for p in str(backend).split(",")]
    return "cuda" if any(name == "nccl" or device == "cuda" for device, _, name in parts) else "cpu"


def local_cuda_index(local_rank: int | None = None) -> int:
    """This process's CUDA ordinal: ``LOCAL_RANK % device_count()``, since launchers that show each
    process only its own GPU (SLURM ``--gpus-per-task=1``) leave LOCAL_RANK counting 0..7."""
    count = torch.cuda.device_count()
    if count < 1:
        raise RuntimeError("a CUDA backend was asked for but no CUDA device is visible: use backend 'gloo' "
                           "(CPU) or check CUDA_VISIBLE_DEVICES")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return local_rank % count


def init_paro_mesh(group_size: int, backend: str | None = None) -> DeviceMesh:
    """Initialise the process group if needed and return the (n // m, m) mesh. On CUDA this GPU is
    passed as ``device_id``, so NCCL binds its communicators to it at once."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if device_type_for_backend(backend) == "cuda":
            device = torch.device("cuda", local_cuda_index())
            torch.cuda.set_device(device)
            dist.init_process_group(backend, device_id=device)
        else:
            dist.init_process_group(backend)
    world = dist.get_world_size()
    if world % group_size != 0:
        raise ValueError(f"world size {world} is not divisible by group_size {group_size}: pick a group size that "
                         f"divides it (e.g. the GPUs per node; divisors of {world}: "
                         f"{[d for d in range(1, world + 1) if world % d == 0]})")
    device_type = device_type_for_backend(dist.get_backend())
    if device_type == "cuda":
        torch.cuda.set_device(local_cuda_index())
    # one mesh per shape and default group (each mesh creates process groups: threads, sockets);
    # keyed by the default group itself, so a re-initialised world never matches
    cached = _MESHES.get((world, group_size))
    if cached is None or cached[0] is not dist.group.WORLD:
        mesh = init_device_mesh(device_type, (world // group_size, group_size), mesh_dim_names=MESH_DIMS)
        cached = _MESHES[(world, group_size)] = (dist.group.WORLD, mesh)
    return cached[1]


def mesh_device(info_or_mesh: "MeshInfo | DeviceMesh") -> torch.device:
    """Where every buffer of a model sharded on this mesh lives (this process's GPU on CUDA)."""
    mesh = info_or_mesh.mesh if isinstance(info_or_mesh, MeshInfo) else info_or_mesh
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


_MESHES: dict[tuple[int, int], tuple[object, DeviceMesh]] = {}


class Coords(Protocol):
    """The mesh's sizes and one rank's coordinates (``MeshInfo``, or the tests' ``MeshCoords``)."""

    g: int
    m: int
    k: int
    l: int  # noqa: E741

    @property
    def n(self) -> int: ...


@dataclass
class MeshGroups:
    """The mesh's sizes and c10d group names: all a collective needs, as plain data, so the graph
    passes can hold one without keeping process groups alive past ``destroy_process_group``."""

    g: int  # number of groups (size of "inter")
    m: int  # ranks per group (size of "intra")
    group_names: dict[str, str]  # "intra" / "inter" / "global" -> c10d group name

    @property
    def n(self) -> int:
        return self.g * self.m

    def size(self, dim: str) -> int:
        return {"intra": self.m, "inter": self.g, "global": self.n}[dim]


@dataclass
class MeshInfo(MeshGroups):
    """Plus this rank's coordinates and the mesh, read once (``from_mesh``)."""

    k: int  # this rank's group index
    l: int  # this rank's index inside its group  # noqa: E741
    mesh: DeviceMesh
    # the user's mesh the parameters are DTensors on: a 1D mesh as given (FSDP2's placements on it,
    # one all-reduce in clip_grad_norm_), else ``mesh``
    param_mesh: DeviceMesh | None = None

    @property
    def groups(self) -> MeshGroups:
        return MeshGroups(self.g, self.m, dict(self.group_names))

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> "MeshInfo":
        """Any 2D mesh, dimension 0 across groups and 1 inside a group, whatever its names (the
        HSDP convention ``("replicate", "shard")`` is the same order); a 1D mesh is one group."""
        given, mesh = mesh, as_2d(mesh)
        dims = tuple(mesh.mesh_dim_names)
        with unset_fake_temporarily():  # DeviceMesh builds rank tensors: keep them real under FakeTensorMode
            k, l = mesh.get_coordinate()
            names = {dim: mesh.get_group(i).group_name for i, dim in enumerate(MESH_DIMS)}
            names["global"] = mesh[dims]._flatten().get_group().group_name
        return cls(mesh.size(0), mesh.size(1), names, k, l, mesh, given if given.ndim == 1 else mesh)


_AS_2D: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def as_2d(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh PaRO shards on: a named 2D mesh as given; an unnamed 2D mesh named ``("inter",
    "intra")``; a 1D mesh as ``(1, n)``, one group (built once per mesh: new process groups)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError("mesh must be a torch DeviceMesh (init_device_mesh or init_paro_mesh), "
                        f"got {type(mesh).__name__}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is not None:
        return mesh
    if mesh.ndim not in (1, 2):
        raise ValueError(f"PaRO shards on a 1D or 2D DeviceMesh (dim 0 across groups, dim 1 inside a group), got "
                         f"{mesh.ndim} dims {mesh.mesh_dim_names}: pass the data-parallel part, "
                         "e.g. mesh['dp_replicate', 'dp_shard']")
    cached = _AS_2D.get(id(mesh))
    if cached is None or cached[0] is not mesh:
        with unset_fake_temporarily():
            ranks = mesh.mesh.reshape(1, -1) if mesh.ndim == 1 else mesh.mesh
            cached = _AS_2D[id(mesh)] = (mesh, DeviceMesh(mesh.device_type, ranks, mesh_dim_names=MESH_DIMS))
    return cached[1]
