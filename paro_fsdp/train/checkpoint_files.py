"""What a checkpoint folder must prove before DCP may read it: intact files, this model's
shapes, and nothing in it that executes code.

Why: DCP stores no checksums, so a truncated or bit-flipped shard loads as wrong weights, and a
checkpoint of a larger model loads silently into the matching subset of a smaller one. DCP also
unpickles ``.metadata`` and every non-tensor value with a full unpickler, so a crafted folder
could run code; here ``.metadata`` is read by an unpickler that knows only DCP's own metadata
classes, and every non-tensor value must pass ``torch.load(weights_only=True)`` first.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

MANIFEST = "paro_manifest.json"


def disk_failure(exc: BaseException) -> bool:
    """Whether a failed save is the file system's doing (full disk, permissions, I/O), as opposed
    to a lost peer, which the trainer reports as such."""
    return isinstance(exc, OSError) or any(isinstance(c, OSError) for _, c in dcp_causes(exc))


def dcp_causes(exc: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, error) of each rank DCP's CheckpointException reports, lowest rank first; [] for
    any other exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [(rank, c[0] if isinstance(c, tuple) else c) for rank, c in sorted(failures.items(), key=lambda kv: kv[0])]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or must not be read; the message is one line naming
    the folder, the file or tensor, and the fix."""


# ---- .metadata without arbitrary code --------------------------------------------------------
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # any class defined there
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get(module, set())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _ALLOWED and (allowed is None or name in allowed):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with an allow-list of DCP's classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a DCP metadata file this trainer will read ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        # what FileSystemReader.read_metadata does after unpickling
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (step counters, param groups) are plain data: loadable with
    ``weights_only=True``, which is checked before DCP's own (full) unpickling runs."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception:  # noqa: BLE001 - any refusal: the value is not plain data
            raise CheckpointError(f"checkpoint value {read_item.dest_index.fqn} is not plain data (torch.load with "
                                  f"weights_only=True refuses it); it is not unpickled") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def first_line(exc: BaseException, prefer: type[BaseException] = BaseException) -> str:
    """The cause of ``exc`` in one line (DCP's CheckpointException lists every rank's traceback:
    the lowest failing rank whose error is a ``prefer`` is the message, else the lowest failing
    rank). A full disk reaches one rank as ``OSError: No space left on device`` and another as
    torch's zip writer's ``unexpected pos``: ``prefer=OSError`` names the first."""
    causes = dcp_causes(exc)
    if causes:
        rank, cause = next(((r, c) for r, c in causes if isinstance(c, prefer)), causes[0])
        return f"rank {rank}: {type(cause).__name__}: {first_line(cause)}"
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# ---- the manifest: sizes and CRC32 of every file ---------------------------------------------
def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: str, step: int) -> None:
    """Every rank checksums the shard files it wrote (``__<rank>_*``, still in its page cache);
    rank 0 adds ``.metadata`` and writes the manifest. Collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {n: {"bytes": os.path.getsize(os.path.join(folder, n)), "crc32": _crc32(os.path.join(folder, n))}
            for n in sorted(os.listdir(folder)) if n.startswith(f"__{rank}_")}
    if rank == 0:
        mine[".metadata"] = {"bytes": os.path.getsize(os.path.join(folder, ".metadata")),
                             "crc32": _crc32(os.path.join(folder, ".metadata"))}
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
    """The first problem of ``folder`` against its manifest, on any rank (None: intact, or no
    manifest to check against). Each rank checksums a share of the files. Collective."""
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
        return f"{name} has {size} bytes, the manifest says {want['bytes']} ({'truncated' if size < want['bytes'] else 'grown'})"
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
    """Why ``states`` cannot take this checkpoint's tensors (None: every tensor under ``scope``
    exists on both sides with the same global shape). A partial load is never silent."""
    ours = {k: tuple(t.shape) for name, s in states.items()
            for k, t in _tensors(s.state_dict() if hasattr(s, "state_dict") else s, f"{name}.")}
    theirs = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    for key in sorted(k for k in ours if k.startswith(scope)):
        if key not in theirs:
            return f"it has no tensor {key} (a model with other layers or names)"
        if theirs[key] != ours[key]:
            hint = ""
            if key.endswith(("tok_embeddings.weight", "output.weight")) and theirs[key][1:] == ours[key][1:]:
                hint = (f": its vocabulary has {theirs[key][0]} rows, this model {ours[key][0]}; model.tokenizer and "
                        f"model.vocab_size must be those of the run that wrote it")
            return f"{key} is {list(theirs[key])} there, {list(ours[key])} here{hint}"
    extra = sorted(k for k in theirs if k.startswith(scope) and k not in ours)
    if extra:
        return f"it holds {len(extra)} tensors this model lacks, e.g. {extra[0]} (a larger model)"
    return None
