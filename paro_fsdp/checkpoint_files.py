"""What a checkpoint folder must prove before DCP may read it: intact files, this model's
shapes, and nothing in it that executes code.

Why: DCP stores no checksums (a damaged shard loads as wrong weights), loads a larger model's
checkpoint silently into the matching subset of a smaller one, and unpickles ``.metadata`` and
every non-tensor value with a full unpickler, so a crafted folder would run code on every rank.
``safe_load`` is the one way this project reads one: ``.metadata`` through an unpickler resolving
only DCP's metadata classes, every non-tensor value through ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import zlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, HuggingFaceStorageReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

MANIFEST = "paro_manifest.json"


def short_write(exc: BaseException) -> bool:
    """torch's zip writer found fewer bytes on disk than it wrote: a disk filling inside ``torch.save``
    (then no rank's error is an ``OSError``)."""
    return isinstance(exc, RuntimeError) and "unexpected pos" in str(exc) and "inline_container" in str(exc)


def disk_failure(exc: BaseException) -> bool:
    """Whether a failed save is the file system's doing, not a lost peer's."""
    causes = [exc] + [c for _, c in dcp_causes(exc)]
    return any(isinstance(c, OSError) or short_write(c) for c in causes)


def dcp_causes(exc: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, error) of each rank DCP's CheckpointException reports, lowest first; [] for others."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [(rank, c[0] if isinstance(c, tuple) else c) for rank, c in sorted(failures.items(), key=lambda kv: kv[0])]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or must not be read: one line naming it and the fix."""


# ---- .metadata without arbitrary code --------------------------------------------------------
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object for every global a DCP ``.metadata`` pickle names, and nothing else. Why a
    table: allowing "a module" allows everything it imports (``os.system`` is an attribute of DCP's
    metadata module). Each object here only stores its arguments or state."""
    from torch.distributed.checkpoint import metadata as md

    table: dict[tuple[str, str], Any] = {}
    for cls in (md.Metadata, md.MetadataIndex, md.StorageMeta, md.TensorProperties, md.TensorStorageMetadata,
                md.BytesStorageMetadata, md.ChunkStorageMetadata, md._MEM_FORMAT_ENCODING):  # noqa: SLF001
        table["torch.distributed.checkpoint.metadata", cls.__name__] = cls
    table["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = _StorageInfo
    table["torch.serialization", "_get_layout"] = torch.serialization._get_layout  # noqa: SLF001
    table["torch", "Size"] = torch.Size
    table.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    # checkpoint_id as saved on either OS (a WindowsPath cannot be instantiated on Linux: its pure twin)
    for name, cls in (("PosixPath", pathlib.PurePosixPath if os.name == "nt" else pathlib.PosixPath),
                      ("PurePosixPath", pathlib.PurePosixPath), ("WindowsPath", pathlib.PureWindowsPath),
                      ("PureWindowsPath", pathlib.PureWindowsPath)):
        table["pathlib", name] = table["pathlib._local", name] = cls  # pathlib._local: Python 3.13's module
    return table


_METADATA_GLOBALS = _metadata_globals()


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves a global only through ``_METADATA_GLOBALS``: nothing imported, no attribute followed."""

    def find_class(self, module: str, name: str) -> Any:
        if "." in name:
            raise pickle.UnpicklingError(f"global {module} {name}: a dotted name (an attribute of an attribute), "
                                         f"never part of DCP metadata")
        try:
            return _METADATA_GLOBALS[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata") from None


def read_metadata_file(path: str | os.PathLike) -> Metadata:
    """Every storage entry must name a file inside the folder (else any file on the machine could
    feed the weights). Raises ``CheckpointError`` (one line)."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - whatever a malformed pickle raises: refused, one line
        raise CheckpointError(f"{path}: not a DCP metadata file this trainer will read ({first_line(exc)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    problem = _metadata_problem(metadata)
    if problem:
        raise CheckpointError(f"{path}: not a DCP metadata file this trainer will read ({problem})")
    return metadata


def _metadata_problem(metadata: Metadata) -> Optional[str]:
    """Why DCP must not act on ``metadata``, or None."""
    if not isinstance(metadata.state_dict_metadata, dict):
        return "state_dict_metadata is not a dict"
    if not isinstance(metadata.storage_data, dict):
        return "storage_data is not a dict"
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            return f"a storage entry is a {type(info).__name__}, not a file's place"
        if os.path.isabs(info.relative_path) or os.path.normpath(info.relative_path).split(os.sep)[0] == "..":
            return f"storage entry {info.relative_path!r} lies outside the checkpoint folder"
    return None


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by ``read_metadata_file``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        # what FileSystemReader.read_metadata does after unpickling
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (step counters, param groups, RNG states) deserialised by
    ``torch.load(weights_only=True)`` only, stored where ``DefaultLoadPlanner`` would."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception:  # noqa: BLE001 - any refusal: the value is not plain data
            raise CheckpointError(f"checkpoint value {fqn} is not plain data (torch.load with weights_only=True "
                                  f"refuses it); it is not unpickled") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def safe_load(state: dict[str, Any], path: Optional[str] = None, *, storage_reader: Any = None) -> None:
    """``dcp.load`` that cannot run code. ``storage_reader``: a ``SafeReader`` or torch's
    ``HuggingFaceStorageReader``; any other is refused. Collective. Raises ``CheckpointError``
    (hostile or malformed ``.metadata``) or DCP's ``CheckpointException``."""
    if storage_reader is None:
        if path is None:
            raise TypeError("safe_load needs a path or a storage_reader")
        storage_reader = SafeReader(path)
    elif not isinstance(storage_reader, (SafeReader, HuggingFaceStorageReader)):
        raise TypeError(f"safe_load reads with SafeReader or HuggingFaceStorageReader, not "
                        f"{type(storage_reader).__name__}: another reader may unpickle .metadata with a full unpickler")
    if isinstance(storage_reader, SafeReader) and os.path.isfile(storage_reader._get_metadata_path()):  # noqa: SLF001
        # a refusal surfaces here as one CheckpointError; inside dcp.load it would become a
        # fallback to rank-local metadata and a multi-line CheckpointException
        storage_reader.read_metadata()
    dcp.load(state, storage_reader=storage_reader, planner=SafeLoadPlanner())


def first_line(exc: BaseException, prefer: type[BaseException] = BaseException) -> str:
    """The cause of ``exc`` in one line: of a DCP CheckpointException, the lowest failing rank whose
    error is a ``prefer`` (a full disk is an ``OSError`` on one rank, not on another), else the lowest."""
    causes = dcp_causes(exc)
    if causes:
        rank, cause = next(((r, c) for r, c in causes if isinstance(c, prefer)), causes[0])
        return f"rank {rank}: {type(cause).__name__}: {first_line(cause)}"
    if short_write(exc):
        return f"the disk is full or failing (torch's writer stopped short: {str(exc).split('] . ')[-1].strip()})"
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# ---- the manifest: sizes and CRC32 of every file ---------------------------------------------
def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _entry(path: str) -> dict[str, int]:
    return {"bytes": os.path.getsize(path), "crc32": _crc32(path)}


def write_manifest(folder: str, step: int) -> None:
    """Every rank checksums the shard files it wrote (``__<rank>_*``, still in its page cache);
    rank 0 adds ``.metadata`` and writes the manifest. Collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {n: _entry(os.path.join(folder, n)) for n in sorted(os.listdir(folder)) if n.startswith(f"__{rank}_")}
    if rank == 0:
        mine[".metadata"] = _entry(os.path.join(folder, ".metadata"))
    parts: list[Any] = [mine]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    if rank == 0:
        files = {k: v for p in parts for k, v in p.items()}
        with open(os.path.join(folder, MANIFEST), "w") as f:
            json.dump({"format": 1, "step": step, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def verify(folder: str) -> Optional[str]:
    """The first problem against the manifest on any rank (None: intact, or no manifest); each rank
    checksums a share. Collective."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = None
    path = os.path.join(folder, MANIFEST)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as exc:
            files, problem = {}, f"{MANIFEST} is unreadable ({first_line(exc)})"
        for i, (name, want) in enumerate(sorted(files.items())):
            problem = problem or _check_file(os.path.join(folder, name), want, check_crc=(i % world == rank))
    if dist.is_initialized():
        problems: list[Any] = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    return problem


def _check_file(path: str, want: dict[str, int], check_crc: bool) -> Optional[str]:
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    if size != want["bytes"]:
        how = "truncated" if size < want["bytes"] else "grown"
        return f"{name} has {size} bytes, the manifest says {want['bytes']} ({how})"
    if check_crc and _crc32(path) != want["crc32"]:
        return f"{name} does not match its CRC32 checksum (corrupted on disk)"
    return None


# ---- this model's shapes against the checkpoint's ----------------------------------------------
def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Tensor leaves reachable through dicts, keyed as DCP flattens them (``a.b.c``)."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}{k}.")
    elif isinstance(state, torch.Tensor):
        yield prefix[:-1], state


def shape_problem(metadata: Metadata, states: dict[str, Any], scope: str = "optimizer.master.") -> Optional[str]:
    """Why ``states`` cannot take the tensors under ``scope``, or None: a partial load is never silent."""
    ours = {k: tuple(t.shape) for name, s in states.items()
            for k, t in _tensors(s.state_dict() if hasattr(s, "state_dict") else s, f"{name}.")}
    theirs = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    for key in sorted(k for k in ours if k.startswith(scope)):
        if key not in theirs:
            return f"it has no tensor {key} (a model with other layers or names)"
        if theirs[key] != ours[key]:
            hint = ""
            if key.endswith(("tok_embeddings.weight", "output.weight")) and theirs[key][1:] == ours[key][1:]:
                hint = (f": its vocabulary has {theirs[key][0]} rows, this model {ours[key][0]} "
                        "(another model.tokenizer or model.vocab_size)")
            return f"{key} is {list(theirs[key])} there, {list(ours[key])} here{hint}"
    extra = sorted(k for k in theirs if k.startswith(scope) and k not in ours)
    if extra:
        return f"it holds {len(extra)} tensors this model lacks, e.g. {extra[0]} (a larger model)"
    return None
