"""The calibration kept per cluster: ``strategy="auto"`` without ``cluster=`` (``paro_shard``,
``fully_shard``, the trainer's ``paro_strategy = "auto"``) reads what this mesh measured before
instead of measuring it again at every start.

Why: a calibration takes seconds and its timings move between runs, so the same model, cluster
and budget picked different plans run after run; kept, the plan is a function of its inputs.

The key is what the measurement depends on: device, world / group / inter sizes, backend, hosts
(hashed), torch version and ``calibrate_in_process``'s arguments. The file is a cluster TOML in
:func:`cache_dir`, the key's hash in its name and in ``[measured]``. Rank 0 reads it, or every rank
calibrates and rank 0 writes it; every rank plans with rank 0's cluster.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ..models.llama import LlamaArgs, flavor
from . import calibrate
from .cluster import AdvisorError, Cluster, cluster_from_dict, cluster_to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["CACHE_DIR_ENV", "RECALIBRATE_ENV", "Calibration", "cache_dir", "cached_calibration", "calibration_key"]

CACHE_DIR_ENV = "PARO_FSDP_CACHE_DIR"  # the cache's root, as TORCHINDUCTOR_CACHE_DIR is inductor's
RECALIBRATE_ENV = "PARO_FSDP_RECALIBRATE"  # "1": measure again and overwrite the kept cluster
# Part of the key: raise it when calibrate_in_process measures differently, so old files miss.
FORMAT = 1


class Calibration(NamedTuple):
    """The cluster every rank plans with, where it is kept, whether it was read; ``source``: for the log."""

    cluster: Cluster
    path: Path
    cached: bool
    source: str


def cache_dir() -> Path:
    """``$PARO_FSDP_CACHE_DIR/clusters``, else ``$XDG_CACHE_HOME/paro_fsdp/clusters``, else
    ``~/.cache/paro_fsdp/clusters``."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "paro_fsdp")
    return Path(root).expanduser() / "clusters"


def _recalibrate_from_env() -> bool:
    return os.environ.get(RECALIBRATE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def calibration_key(mesh: Any, model_args: Optional[Union[str, LlamaArgs]], micro_batch: int, seq_len: int,
                    dtype: str) -> dict[str, Any]:
    """What a calibration depends on (module docstring). Collective: the host names are gathered, so a
    job moved to other nodes, or laid out over them differently, measures again."""
    sizes = {d: dist.get_world_size(mesh.get_group(d)) for d in ("inter", "intra")}
    device = mesh.device_type
    name = torch.cuda.get_device_name(torch.cuda.current_device()) if device == "cuda" else device
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    args = flavor(model_args) if isinstance(model_args, str) else model_args
    return {"format": FORMAT, "torch": torch.__version__, "device": device, "device_name": name,
            "backend": str(dist.get_backend()), "world": dist.get_world_size(), "inter": sizes["inter"],
            "intra": sizes["intra"], "hosts": hashlib.sha256("\n".join(map(str, hosts)).encode()).hexdigest()[:16],
            "dtype": dtype, "micro_batch": micro_batch, "seq_len": seq_len,
            "model": None if args is None else dataclasses.asdict(args)}


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _path(key: dict[str, Any]) -> Path:
    return cache_dir() / f"{key['device']}_{key['inter']}x{key['intra']}_{_digest(key)}.toml"


def _parse(text: str, where: str, digest: str) -> Cluster:
    data = tomllib.loads(text)
    measured = data.get("measured")
    got = measured.get("cache_key") if isinstance(measured, dict) else None
    if got != digest:
        raise AdvisorError(f"its cache_key is {got!r}, not this key's {digest!r}")
    return cluster_from_dict(data, where)


def _read(path: Path, digest: str) -> Optional[Cluster]:
    """The kept cluster, or None (one that does not read is warned of: a cache never stops a start)."""
    try:
        return _parse(path.read_text(), str(path), digest)
    except FileNotFoundError:
        return None
    except Exception as exc:  # whatever is wrong with the file, it is measured over
        reason = " ".join(str(exc).split())
        warnings.warn(f"paro_fsdp: the cached cluster {path} is unreadable ({reason}); calibrating again",
                      stacklevel=3)
        return None


def _keep(cluster: Cluster, key: dict[str, Any], path: Path) -> tuple[Cluster, bool]:
    """(the cluster as the file holds it, so this run and the next plan from the same numbers; written)."""
    measured = {**cluster.measured, "cache_key": _digest(key)}
    comments = ["calibrated by paro_fsdp (strategy=\"auto\" without cluster=), kept by paro_fsdp.cost."
                "calibration_cache", f"at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; delete this "
                f"file or set {RECALIBRATE_ENV}=1 to measure again", f"key: {json.dumps(key, sort_keys=True)}"]
    text = cluster_to_toml(dataclasses.replace(cluster, measured=measured), comments)
    kept = cluster_from_dict(tomllib.loads(text), str(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)  # a reader on the same host never sees half a file
    except OSError as exc:
        warnings.warn(f"paro_fsdp: could not keep the calibrated cluster at {path} ({exc}); the next start "
                      f"calibrates again (set {CACHE_DIR_ENV} to a writable folder)", stacklevel=3)
        tmp.unlink(missing_ok=True)
        return kept, False
    return kept, True


def _from_rank0(value: Any) -> Any:
    if dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def cached_calibration(mesh: Any, model_args: Optional[Union[str, LlamaArgs]] = None, micro_batch: int = 1,
                       seq_len: int = 128, dtype: str = "bf16", recalibrate: Optional[bool] = None) -> Calibration:
    """``calibrate_in_process``'s cluster, read from :func:`cache_dir` when kept, else measured and
    kept. Collective; every rank gets rank 0's. ``recalibrate=True`` (or ``PARO_FSDP_RECALIBRATE=1``
    when None) measures again and overwrites the file."""
    key = calibration_key(mesh, model_args, micro_batch, seq_len, dtype)
    path, digest = _path(key), _digest(key)
    fresh = _recalibrate_from_env() if recalibrate is None else recalibrate
    rank0 = dist.get_rank() == 0
    cached = _from_rank0(_read(path, digest) if rank0 and not fresh else None)
    if cached is not None:
        return Calibration(cached, path, True, f"cluster read from the calibration cache {path} "
                                               f"({RECALIBRATE_ENV}=1 measures it again)")
    start = time.perf_counter()
    cluster = calibrate.calibrate_in_process(mesh, model_args, micro_batch, seq_len, dtype)
    seconds = time.perf_counter() - start
    kept, written = _keep(cluster, key, path) if rank0 else (cluster, False)
    kept, written = _from_rank0((kept, written))
    where = f"kept at {path}" if written else "not kept"
    return Calibration(kept, path, False, f"cluster calibrated now ({seconds:.1f} s), {where}")
