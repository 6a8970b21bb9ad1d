"""The cluster the cost model prices: GPUs, their memory and FLOP/s, and the links between them.

Why a file format: a user describes the cluster once (or measures it with ``python -m
tools.calibrate``) and every prediction reads it; presets ship in ``paro_fsdp/cost/clusters/``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from ..collectives import KINDS, Dim, Kind, hops

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["AdvisorError", "Cluster", "GB", "GiB", "Link", "cluster_from_dict", "cluster_to_toml", "link_for",
           "link_seconds", "load_cluster", "presets"]

GB, GiB = 1e9, 2**30


class AdvisorError(ValueError):
    """Bad input to the advisor (flavor, sizes, cluster file), in one line naming what is wrong."""


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
    """Seconds of ``count`` collectives sending ``nbytes_ring`` ring bytes in all: the alpha-beta model."""
    bw, lat = link.cost(kind)
    return count * hops(kind, k) * lat + nbytes_ring / bw


@dataclass(frozen=True)
class Cluster:
    """The hardware, read from a TOML file (:func:`load_cluster`). ``inter.bandwidth_gbs``: the per-GPU
    share of the node's network (line rate x efficiency / GPUs per node); ``node_gbps`` /
    ``inter_efficiency`` say where it came from, for the inter-bandwidth sweep."""

    name: str
    gpus_per_node: int
    memory_gib: float
    achieved_tflops: float
    memory_bandwidth_gbs: float
    intra: Link
    inter: Link
    overlap: float = 0.8
    intra_overlap: Optional[float] = None  # the intra dimension's, where it differs (None: ``overlap``)
    usable_memory_fraction: float = 0.9
    node_gbps: Optional[float] = None
    inter_efficiency: Optional[float] = None
    description: str = ""
    source: str = ""
    measured: Mapping[str, Any] = field(default_factory=dict)

    def overlap_of(self, dim: str) -> float:
        """The fraction of compute a collective on ``dim`` hides behind: on a shared host an intra one is a
        copy competing with compute for the cores, an inter one waits on a network."""
        return self.intra_overlap if dim == Dim.INTRA and self.intra_overlap is not None else self.overlap

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * GiB * self.usable_memory_fraction


# The file's schema, read and written from these tables: field -> (type, rule, required).
# peak_tflops and matmul_tflops document a preset; the model reads neither.
_RULES = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, "in [0, 1]": lambda v: 0 <= v <= 1, "": lambda v: True}
_TOP = {"name": (str, "", False), "description": (str, "", False), "source": (str, "", False),
        "gpus_per_node": (int, "> 0", True), "memory_gib": (float, "> 0", True),
        "usable_memory_fraction": (float, "in [0, 1]", False), "achieved_tflops": (float, "> 0", True),
        "memory_bandwidth_gbs": (float, "> 0", True), "overlap": (float, "in [0, 1]", False),
        "intra_overlap": (float, "in [0, 1]", False),
        "peak_tflops": (float, "", False), "matmul_tflops": (float, "", False)}
_LINK = {"bandwidth_gbs": (float, "> 0", True), "latency_us": (float, ">= 0", True),
         **{f"{k}_{u}": (float, rule, False) for k in KINDS for u, rule in (("gbs", "> 0"), ("latency_us", ">= 0"))}}
_INTER = {**_LINK, "node_gbps": (float, "", False), "efficiency": (float, "", False)}


def _fields(where: str, section: str, table: Any, schema: Mapping[str, tuple], tables: Sequence[str] = ()) -> dict:
    """The table's fields checked against ``schema``; every problem names the field."""
    if not isinstance(table, dict):
        raise AdvisorError(f"{where}: missing section [{section}] (fields: bandwidth_gbs, latency_us)")
    full = (lambda key: f"{section}.{key}") if section else (lambda key: key)
    for key in table:
        if key not in schema and key not in tables:
            raise AdvisorError(f"{where}: unknown field {full(key)!r}; valid: "
                               f"{', '.join([*schema, *(f'[{t}]' for t in tables)])}")
    out = {}
    for key, (typ, rule, required) in schema.items():
        if key not in table:
            if required:
                raise AdvisorError(f"{where}: missing field {full(key)!r}")
            continue
        v = table[key]
        if isinstance(v, bool) or not isinstance(v, (int, float) if typ is float else typ):
            raise AdvisorError(f"{where}: field {full(key)!r} must be a {typ.__name__}, got {v!r}")
        out[key] = typ(v)
        if not _RULES[rule](out[key]):
            raise AdvisorError(f"{where}: field {full(key)!r} must be {rule}, got {v}")
    return out


def _link(values: dict) -> Link:
    base = (values["bandwidth_gbs"], values["latency_us"])
    per_kind = {k: (values.get(f"{k}_gbs", base[0]), values.get(f"{k}_latency_us", base[1])) for k in KINDS}
    return Link(*base, {k: v for k, v in per_kind.items() if v != base})


def cluster_from_dict(data: Mapping[str, Any], where: str = "cluster") -> Cluster:
    """Validate a parsed cluster TOML; every problem names the field."""
    top = _fields(where, "", dict(data), _TOP, ("intra", "inter", "measured"))
    intra = _fields(where, "intra", data.get("intra"), _LINK)
    inter = _fields(where, "inter", data.get("inter"), _INTER)
    measured = data.get("measured", {})
    if not isinstance(measured, dict):
        raise AdvisorError(f"{where}: [measured] must be a table")
    known = {f.name for f in dataclasses.fields(Cluster)}
    return Cluster(**{"name": Path(str(where)).stem, **{k: v for k, v in top.items() if k in known}},
                   intra=_link(intra), inter=_link(inter), node_gbps=inter.get("node_gbps"),
                   inter_efficiency=inter.get("efficiency"), measured=dict(measured))


def presets() -> Traversable:
    """The folder of shipped cluster files (package data of ``paro_fsdp.cost``)."""
    return resources.files(__package__) / "clusters"


def load_cluster(name: Union[str, os.PathLike]) -> Cluster:
    """Read and validate a cluster TOML: a path, or a preset name such as ``a100_ib`` (``.toml`` optional)."""
    p, folder = Path(name), presets()
    path = next((c for c in (p, folder / p.name, folder / f"{p.name}.toml") if c.is_file()), None)
    if path is None:
        names = sorted(q.name for q in folder.iterdir() if q.name.endswith(".toml")) if folder.is_dir() else []
        raise AdvisorError(f"cluster file {str(name)!r} not found (as a path, or in {folder}); "
                           f"presets: {', '.join(names)}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise AdvisorError(f"cluster file {path}: not valid TOML: {exc}") from None
    return cluster_from_dict(data, str(path))


def _toml_value(v: Any) -> str:
    """JSON spells numbers, booleans, strings and arrays as TOML does (floats kept to 9 digits)."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(_toml_value, v)) + "]"
    return json.dumps(float(f"{v:.9g}") if isinstance(v, float) else v)


def cluster_to_toml(c: Cluster, comments: Sequence[str] = ()) -> str:
    """A cluster as TOML text that :func:`load_cluster` reads back."""
    def table(values: Mapping[str, Any]) -> list[str]:
        return [f"{k} = {_toml_value(v)}" for k, v in values.items() if v not in ("", None)]

    lines = [f"# {line}" for line in comments] + table({k: getattr(c, k, None) for k in _TOP})
    for section, link in (("intra", c.intra), ("inter", c.inter)):
        values = {"bandwidth_gbs": link.bandwidth_gbs, "latency_us": link.latency_us}
        for kind, (bw, lat) in sorted(link.per_kind.items()):
            values.update({f"{kind}_gbs": bw, f"{kind}_latency_us": lat})
        if section == "inter":
            values.update(node_gbps=c.node_gbps, efficiency=c.inter_efficiency)
        lines += ["", f"[{section}]", *table(values)]
    if c.measured:
        lines += ["", "[measured]", *(f"{k} = {_toml_value(v)}" for k, v in c.measured.items())]
    return "\n".join(lines) + "\n"


def _scaled(link: Link, factor: float, cap: Link) -> Link:
    """``link`` with ``factor`` times its bandwidth, at most ``cap``'s, kind by kind."""
    def bw(kind: str) -> float:
        return min(link.cost(kind)[0] * factor, cap.cost(kind)[0]) / GB

    per_kind = {k: (bw(k), link.cost(k)[1] * 1e6) for k in KINDS}
    return Link(bw(Kind.ALL_GATHER), link.latency_us, per_kind)


def link_for(dim: str, cluster: Cluster, n: Optional[int] = None, m: Optional[int] = None) -> Link:
    """The link a mesh dimension's rings run on, per GPU. Without the mesh shape (inductor's estimates):
    ``intra`` for the intra dimension, ``inter`` for any other. With it: rings inside a node run on
    NVLink; else the node's network is shared by the rings leaving it at once: inter dim with m
    dividing the GPUs per node, inter x (GPUs/node) / m; intra dim over whole nodes, inter x GPUs/node;
    never faster than NVLink; any other layout the plain per-GPU share."""
    if n is None or m is None:
        return cluster.intra if dim == Dim.INTRA else cluster.inter
    gpn = cluster.gpus_per_node
    if dim == Dim.INTRA:
        if m <= gpn and gpn % m == 0:
            return cluster.intra
        return _scaled(cluster.inter, gpn, cluster.intra) if m % gpn == 0 else cluster.inter
    if n <= gpn:
        return cluster.intra
    if m <= gpn and gpn % m == 0:
        return _scaled(cluster.inter, gpn / m, cluster.intra) if m != gpn else cluster.inter
    return cluster.inter
