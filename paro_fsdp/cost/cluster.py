"""The cluster the cost model prices: GPUs, their memory and FLOP/s, and the links between them.

Why a file format: a user describes the cluster once (or measures it with ``python -m
tools.calibrate``) and every prediction reads it; presets ship in ``paro_fsdp/cost/clusters/``.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from ..collectives import KINDS, hops

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


GB = 1e9


@dataclass(frozen=True)
class Link:
    """One kind of link as seen by one GPU: ring bus bandwidth (GB/s per GPU, all GPUs of the node
    using it at once) and latency per ring step (us); ``per_kind`` overrides both per collective
    kind (``tools.calibrate`` measures each: gloo's reduce-scatter is an all-reduce)."""

    bandwidth_gbs: float
    latency_us: float
    per_kind: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def cost(self, kind: str) -> tuple[float, float]:
        """(bytes per second, seconds per ring step) for a collective of ``kind``."""
        bw, lat = self.per_kind.get(kind, (self.bandwidth_gbs, self.latency_us))
        return bw * GB, lat * 1e-6


def link_seconds(link: Link, kind: str, k: int, nbytes_ring: float, count: float = 1) -> float:
    """Seconds ``count`` collectives of ``kind`` over ``k`` ranks take on ``link``, sending
    ``nbytes_ring`` ring bytes in all (``collectives.ring_bytes``): count x steps x latency +
    bytes / bandwidth (the alpha-beta model)."""
    bw, lat = link.cost(kind)
    return count * hops(kind, k) * lat + nbytes_ring / bw


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["AdvisorError", "Cluster", "GB", "GiB", "Link", "cluster_from_dict", "cluster_to_toml", "link_for",
           "link_seconds", "load_cluster", "presets", "resolve_cluster_path"]

GiB = 2**30


def presets() -> Traversable:
    """The folder of shipped cluster files (package data of ``paro_fsdp.cost``)."""
    return resources.files(__package__) / "clusters"


class AdvisorError(ValueError):
    """Bad input to the advisor (flavor, sizes, cluster file), in one line naming what is wrong."""


@dataclass(frozen=True)
class Cluster:
    """What the cost model knows about the hardware; read from a TOML file (:func:`load_cluster`).

    ``inter.bandwidth_gbs`` is the per-GPU share of the node's network: the node's line rate in
    GB/s x achieved efficiency / GPUs per node. ``node_gbps`` / ``inter_efficiency`` document
    where it came from and let the inter-bandwidth sweep convert Gb/s per node into it."""

    name: str
    gpus_per_node: int
    memory_gib: float
    achieved_tflops: float
    memory_bandwidth_gbs: float
    intra: Link
    inter: Link
    overlap: float = 0.8
    usable_memory_fraction: float = 0.9
    node_gbps: Optional[float] = None
    inter_efficiency: Optional[float] = None
    description: str = ""
    source: str = ""
    measured: Mapping[str, Any] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * GiB * self.usable_memory_fraction

    def efficiency(self) -> float:
        """Fraction of the node's line rate the inter link achieves (for Gb/s conversions)."""
        if self.inter_efficiency is not None:
            return self.inter_efficiency
        if self.node_gbps:
            return self.inter.bandwidth_gbs * self.gpus_per_node * 8 / self.node_gbps
        return 0.9

    def with_node_gbps(self, gbps: float) -> "Cluster":
        """The same cluster with ``gbps`` Gbit/s of network per node (same efficiency)."""
        if gbps <= 0:
            raise AdvisorError(f"inter-node bandwidth must be > 0 Gb/s, got {gbps}")
        eff = self.efficiency()
        inter = replace(self.inter, bandwidth_gbs=gbps / 8 * eff / self.gpus_per_node, per_kind={})
        return replace(self, inter=inter, node_gbps=gbps, inter_efficiency=eff,
                       name=f"{self.name}@{gbps:g}Gbps")

    def node_gbps_equivalent(self, per_gpu_gbs: float) -> float:
        """Gbit/s per node that gives ``per_gpu_gbs`` GB/s per GPU on the inter link."""
        return per_gpu_gbs * self.gpus_per_node * 8 / self.efficiency()


_REQUIRED = {
    "gpus_per_node": int, "memory_gib": float, "achieved_tflops": float, "memory_bandwidth_gbs": float,
}
_OPTIONAL = {
    "name": str, "description": str, "source": str, "overlap": float, "usable_memory_fraction": float,
    "peak_tflops": float, "matmul_tflops": float,
}
_LINK_REQUIRED = {"bandwidth_gbs": float, "latency_us": float}
_LINK_OPTIONAL = {f"{k}_{u}": float for k in KINDS for u in ("gbs", "latency_us")}
_INTER_OPTIONAL = {"node_gbps": float, "efficiency": float}


def _typed(where: str, key: str, value: Any, typ: type) -> Any:
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is str and isinstance(value, str):
        return value
    raise AdvisorError(f"{where}: field {key!r} must be a {typ.__name__}, got {value!r}")


def _link(where: str, section: str, table: Any, extra: Mapping[str, type]) -> tuple[Link, dict[str, Any]]:
    if not isinstance(table, dict):
        raise AdvisorError(f"{where}: missing section [{section}] (fields: {', '.join(_LINK_REQUIRED)})")
    allowed = {**_LINK_REQUIRED, **_LINK_OPTIONAL, **extra}
    for key in table:
        if key not in allowed:
            raise AdvisorError(f"{where}: unknown field '{section}.{key}'; valid: {', '.join(allowed)}")
    values: dict[str, Any] = {}
    for key, typ in _LINK_REQUIRED.items():
        if key not in table:
            raise AdvisorError(f"{where}: missing field '{section}.{key}'")
        values[key] = _typed(where, f"{section}.{key}", table[key], typ)
        if values[key] < 0 or (key == "bandwidth_gbs" and values[key] == 0):
            raise AdvisorError(f"{where}: field '{section}.{key}' must be > 0, got {values[key]}")
    per_kind = {}
    for kind in KINDS:
        bw = table.get(f"{kind}_gbs", values["bandwidth_gbs"])
        lat = table.get(f"{kind}_latency_us", values["latency_us"])
        bw = _typed(where, f"{section}.{kind}_gbs", bw, float)
        lat = _typed(where, f"{section}.{kind}_latency_us", lat, float)
        if bw <= 0 or lat < 0:
            raise AdvisorError(f"{where}: field '{section}.{kind}_gbs' / '_latency_us' must be > 0 / >= 0")
        if (bw, lat) != (values["bandwidth_gbs"], values["latency_us"]):
            per_kind[kind] = (bw, lat)
    rest = {k: _typed(where, f"{section}.{k}", table[k], extra[k]) for k in extra if k in table}
    return Link(values["bandwidth_gbs"], values["latency_us"], per_kind), rest


def cluster_from_dict(data: Mapping[str, Any], where: str = "cluster") -> Cluster:
    """Validate a parsed cluster TOML; every problem names the field."""
    sections = {"intra", "inter", "measured"}
    for key in data:
        if key not in _REQUIRED and key not in _OPTIONAL and key not in sections:
            raise AdvisorError(f"{where}: unknown field {key!r}; valid: "
                               f"{', '.join([*_REQUIRED, *_OPTIONAL, '[intra]', '[inter]', '[measured]'])}")
    values: dict[str, Any] = {}
    for key, typ in _REQUIRED.items():
        if key not in data:
            raise AdvisorError(f"{where}: missing field {key!r}")
        values[key] = _typed(where, key, data[key], typ)
        if values[key] <= 0:
            raise AdvisorError(f"{where}: field {key!r} must be > 0, got {values[key]}")
    opt = {k: _typed(where, k, data[k], t) for k, t in _OPTIONAL.items() if k in data}
    for key in ("overlap", "usable_memory_fraction"):
        if key in opt and not 0 <= opt[key] <= 1:
            raise AdvisorError(f"{where}: field {key!r} must be in [0, 1], got {opt[key]}")
    intra, _ = _link(where, "intra", data.get("intra"), {})
    inter, extra = _link(where, "inter", data.get("inter"), _INTER_OPTIONAL)
    measured = data.get("measured", {})
    if not isinstance(measured, dict):
        raise AdvisorError(f"{where}: [measured] must be a table")
    return Cluster(
        name=opt.get("name", Path(str(where)).stem), **values, intra=intra, inter=inter, overlap=opt.get("overlap", 0.8), usable_memory_fraction=opt.get("usable_memory_fraction", 0.9),
        node_gbps=extra.get("node_gbps"), inter_efficiency=extra.get("efficiency"),
        description=opt.get("description", ""), source=opt.get("source", ""), measured=dict(measured),
    )


def resolve_cluster_path(name: Union[str, os.PathLike]) -> Union[Path, Traversable]:
    """A path as given, else a preset of ``paro_fsdp/cost/clusters/`` (with or without ``.toml``)."""
    p = Path(name)
    if p.is_file():
        return p
    folder = presets()
    for cand in (folder / p.name, folder / f"{p.name}.toml"):
        if cand.is_file():
            return cand
    names = sorted(q.name for q in folder.iterdir() if q.name.endswith(".toml")) if folder.is_dir() else []
    raise AdvisorError(f"cluster file {str(name)!r} not found (as a path, or in {folder}); presets: {', '.join(names)}")


def load_cluster(name: Union[str, os.PathLike]) -> Cluster:
    """Read and validate a cluster TOML (a path, or a preset name such as ``a100_ib``)."""
    path = resolve_cluster_path(name)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise AdvisorError(f"cluster file {path}: not valid TOML: {exc}") from None
    return cluster_from_dict(data, str(path))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(float(f"{v:.9g}") if isinstance(v, float) else v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    return f'"{s}"'


def cluster_to_toml(c: Cluster, comments: Sequence[str] = ()) -> str:
    """A cluster as TOML text that :func:`load_cluster` reads back."""
    lines = [f"# {line}" for line in comments]
    for key in ("name", "description", "source"):
        if getattr(c, key):
            lines.append(f"{key} = {_toml_value(getattr(c, key))}")
    for key in ("gpus_per_node", "memory_gib", "usable_memory_fraction", "achieved_tflops",
                "memory_bandwidth_gbs", "overlap"):
        lines.append(f"{key} = {_toml_value(getattr(c, key))}")
    for section, link in (("intra", c.intra), ("inter", c.inter)):
        lines += ["", f"[{section}]", f"bandwidth_gbs = {_toml_value(link.bandwidth_gbs)}",
                  f"latency_us = {_toml_value(link.latency_us)}"]
        for kind, (bw, lat) in sorted(link.per_kind.items()):
            lines += [f"{kind}_gbs = {_toml_value(bw)}", f"{kind}_latency_us = {_toml_value(lat)}"]
        if section == "inter":
            if c.node_gbps is not None:
                lines.append(f"node_gbps = {_toml_value(c.node_gbps)}")
            if c.inter_efficiency is not None:
                lines.append(f"efficiency = {_toml_value(c.inter_efficiency)}")
    if c.measured:
        lines += ["", "[measured]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in c.measured.items()]
    return "\n".join(lines) + "\n"


def _scaled(link: Link, factor: float, cap: Link) -> Link:
    """``link`` with ``factor`` times its bandwidth, at most ``cap``'s, kind by kind."""
    def bw(kind: str) -> float:
        return min(link.cost(kind)[0] * factor, cap.cost(kind)[0]) / GB

    per_kind = {k: (bw(k), link.cost(k)[1] * 1e6) for k in KINDS}
    return Link(bw("all_gather"), link.latency_us, per_kind)


def link_for(dim: str, cluster: Cluster, n: Optional[int] = None, m: Optional[int] = None) -> Link:
    """The links a mesh dimension's rings run on, as seen per GPU.

    Without the mesh shape (inductor's estimates, one node at a time): ``intra`` for the intra
    dimension, ``inter`` for any other. With it: rings inside a node run on NVLink; otherwise the
    node's network is shared by the rings of that dimension that leave it at once: inter dim with
    m dividing the GPUs per node, m rings: inter x (GPUs/node) / m per GPU; intra dim with groups
    of whole nodes, one ring: inter x GPUs/node; never faster than NVLink, any other layout the
    plain per-GPU share (conservative)."""
    if n is None or m is None:
        return cluster.intra if dim == "intra" else cluster.inter
    gpn = cluster.gpus_per_node
    if dim == "intra":
        if m <= gpn and gpn % m == 0:
            return cluster.intra
        return _scaled(cluster.inter, gpn, cluster.intra) if m % gpn == 0 else cluster.inter
    if n <= gpn:
        return cluster.intra
    if m <= gpn and gpn % m == 0:
        return _scaled(cluster.inter, gpn / m, cluster.intra) if m != gpn else cluster.inter
    return cluster.inter

