"""Offline data: documents from local files (or the embedded corpus), tokenized, packed into
windows of ``seq_len + 1`` tokens, and dealt out to data-parallel ranks.

Order: windows are shuffled once per epoch by ``(seed, epoch)``, one global sequence whatever the
number of ranks. Step ``s`` consumes samples ``[base + s*B, base + (s+1)*B)``; micro-step ``a`` of
rank ``r`` takes ``local_batch_size`` of them at ``(a * ranks + r) * local_batch_size``. So the whole
position is one integer (``samples_consumed``), still meaningful on a different number of ranks.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .config import JSONL_SUFFIXES, TEXT_SUFFIXES
from .tokenizer import Tokenizer

CORPUS_DIR = Path(__file__).parent / "corpus"


def _files(path: str, suffixes: tuple[str, ...]) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
        if not files:
            raise FileNotFoundError(f"training.dataset_path = {path!r} holds no {'/'.join(suffixes)} files; "
                                    f"valid: such a file, or a folder that holds some")
        return files
    raise FileNotFoundError(f"training.dataset_path = {path!r} does not exist")


def load_documents(dataset: str, path: Optional[str] = None) -> list[str]:
    """The documents in a fixed order (``text``: form-feed separates a file's; ``jsonl``: a ``"text"`` per line)."""
    if dataset == "embedded":
        files, kind = sorted(CORPUS_DIR.glob("*.txt")), "text"
        if not files:
            raise FileNotFoundError(f"the embedded corpus is missing from {CORPUS_DIR} (a broken install?)")
    elif dataset in ("text", "jsonl"):
        files, kind = _files(path or "", TEXT_SUFFIXES if dataset == "text" else JSONL_SUFFIXES), dataset
    else:
        raise ValueError(f"training.dataset = {dataset!r}; valid: embedded, text, jsonl")
    docs: list[str] = []
    for f in files:
        if kind == "text":
            docs.extend(d.strip("\n") for d in f.read_text(encoding="utf-8", errors="replace").split("\f"))
        else:
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{f}:{lineno}: not valid JSON ({exc})") from None
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"{f}:{lineno}: a JSONL record needs a string \"text\" field")
                    docs.append(record["text"])
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"training.dataset = {dataset!r} ({path}) has no non-empty documents; valid: a dataset_path "
                         f"with text")
    return docs


def tokenize_documents(docs: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """One int32 token stream: [BOS] doc [EOS] for every document, in order."""
    bos = np.asarray([tokenizer.bos_id] if tokenizer.bos_id is not None else [], dtype=np.int32)
    eos = np.asarray([tokenizer.eos_id] if tokenizer.eos_id is not None else [], dtype=np.int32)
    return np.concatenate([part for d in docs for part in (bos, tokenizer.encode(d).astype(np.int32), eos)])


def pack_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """[num_windows, seq_len + 1] windows: the model reads ``window[:-1]``, predicts ``window[1:]``; tail dropped."""
    width = seq_len + 1
    n = len(tokens) // width
    if n == 0:
        raise ValueError(f"the dataset has {len(tokens)} tokens, fewer than one window of training.seq_len + 1 = "
                         f"{width}; valid: a smaller training.seq_len, or more text")
    return tokens[: n * width].reshape(n, width)


class DataLoader:
    """This rank's [local_batch_size, seq_len + 1] int64 micro-batches, forever; saved at a step boundary."""

    def __init__(self, windows: np.ndarray, local_batch_size: int, dp_rank: int, dp_world: int, grad_accum: int,
                 seed: int) -> None:
        self.windows = windows
        self.num_windows = len(windows)
        self.local_batch_size, self.dp_rank, self.dp_world = local_batch_size, dp_rank, dp_world
        self.grad_accum, self.seed = grad_accum, seed
        self.global_batch_size = local_batch_size * dp_world * grad_accum
        self.base = 0  # global sample index where the current optimizer step starts
        self.micro = 0  # micro-steps of the current optimizer step already handed out
        self._perm_epoch = -1
        self._perm: Optional[np.ndarray] = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_windows, generator=gen).numpy()
            self._perm_epoch = epoch
        return self._perm  # type: ignore[return-value]

    def sample_indices(self, step_base: int, micro: int) -> list[int]:
        """Global sample indices of this rank's micro-batch."""
        start = step_base + (micro * self.dp_world + self.dp_rank) * self.local_batch_size
        return list(range(start, start + self.local_batch_size))

    def window_of(self, sample: int) -> int:
        """Which window global sample ``sample`` is (its epoch's permutation)."""
        epoch, i = divmod(sample, self.num_windows)
        return int(self._permutation(epoch)[i])

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        rows = [self.window_of(s) for s in self.sample_indices(self.base, self.micro)]
        batch = torch.from_numpy(self.windows[rows].astype(np.int64))
        self.micro += 1
        if self.micro == self.grad_accum:
            self.micro = 0
            self.base += self.global_batch_size
        return batch

    # ---- checkpointing (torch.distributed.checkpoint's Stateful protocol) ----
    def state_dict(self) -> dict[str, Any]:
        if self.micro != 0:
            raise RuntimeError("DataLoader.state_dict() inside an optimizer step: save at a step boundary")
        return {"samples_consumed": self.base, "num_windows": self.num_windows, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_windows"]) != self.num_windows or int(state["seed"]) != self.seed:
            raise ValueError(f"the checkpoint's data position was saved for {state['num_windows']} windows with seed "
                             f"{state['seed']}, but this run has {self.num_windows} windows with seed {self.seed}: the "
                             "dataset, tokenizer, seq_len or seed changed; resume with the same data settings")
        self.base, self.micro = int(state["samples_consumed"]), 0


def build_dataloader(dataset: str, dataset_path: Optional[str], tokenizer: Tokenizer, seq_len: int,
                     local_batch_size: int, dp_rank: int, dp_world: int, grad_accum: int, seed: int) -> DataLoader:
    """Load, tokenize and pack the dataset; return this rank's loader."""
    tokens = tokenize_documents(load_documents(dataset, dataset_path), tokenizer)
    if tokens.max(initial=0) >= tokenizer.vocab_size:
        raise ValueError(f"token id {int(tokens.max())} is outside the tokenizer's vocabulary ({tokenizer.vocab_size})")
    return DataLoader(pack_windows(tokens, seq_len), local_batch_size, dp_rank, dp_world, grad_accum, seed)


def describe(loader: DataLoader, dataset: str, dataset_path: Optional[str]) -> str:
    src = "embedded corpus" if dataset == "embedded" else f"{dataset} {os.path.abspath(dataset_path or '')}"
    steps_per_epoch = loader.num_windows / loader.global_batch_size
    return (f"{src}: {loader.num_windows:,} windows of {loader.windows.shape[1]} tokens "
            f"({steps_per_epoch:.1f} steps per epoch at global batch {loader.global_batch_size})")
