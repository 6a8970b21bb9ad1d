"""Tokenizers for the trainer: a byte-level default, and HuggingFace ``tokenizer.json`` files.

The byte-level one needs no vocabulary file, so the default run works offline (258 ids: the
trainer widens the ``debug`` embedding to fit); a ``tokenizer.json`` needs ``tokenizers``.
"""
from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from .config import ConfigError, JobConfig, tokenizer_spec


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS = 256 and EOS = 257: nothing to download or train,
    and every string round-trips exactly."""

    name = "byte"

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.vocab_size = 256, 257, 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace ``tokenizer.json``, through the ``tokenizers`` package."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError(f"model.tokenizer = {path!r} needs the 'tokenizers' package (pip install tokenizers); "
                               "or use model.tokenizer = \"byte\"") from exc
        self.name = path
        self._tok = _HFTokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.bos_id = next((vocab[t] for t in ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]") if t in vocab), None)
        eos = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[SEP]")
        self.eos_id = next((vocab[t] for t in eos if t in vocab), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(spec: str) -> Tokenizer:
    """``"byte"``, or a ``tokenizer.json`` (or a folder that holds one)."""
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.tokenizer = {spec!r}: no such tokenizer.json; use \"byte\" or the path of a "
                                "HuggingFace tokenizer.json (or the folder holding it)")
    return HFTokenizer(path)


def tokenizer_of(cfg: JobConfig) -> Any:
    """The config's tokenizer; a Hugging Face folder is checked first (without a model its tokenizer does not
    matter)."""
    if cfg.model.name == "hf":
        from paro_fsdp.integrations.hf import HFModelError, read_config, weight_files

        try:
            read_config(cfg.model.hf_path)
            weight_files(cfg.model.hf_path)
        except HFModelError as exc:
            raise ConfigError(str(exc)) from None
    try:
        return build_tokenizer(tokenizer_spec(cfg))
    except (FileNotFoundError, RuntimeError) as exc:
        if isinstance(exc, FileNotFoundError) and cfg.model.name == "hf" and cfg.model.tokenizer == "auto":
            raise ConfigError(f"model.hf_path = {cfg.model.hf_path!r} has no tokenizer.json (model.tokenizer = "
                              f"\"auto\" reads the folder's); valid: --model.tokenizer PATH (a tokenizer.json, or the "
                              f"folder holding one)") from None
        raise ConfigError(str(exc)) from None
