"""Offline data: tokenizer, document loading, packing, sharding over ranks, determinism, resume."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from paro_fsdp.train.data import (
    CORPUS_DIR,
    DataLoader,
    build_dataloader,
    load_documents,
    pack_windows,
    tokenize_documents,
)
from paro_fsdp.train.tokenizer import ByteTokenizer, build_tokenizer


def _loaders(world: int, accum: int, lbs: int = 2, seed: int = 0, n_windows: int = 97):
    windows = np.arange(n_windows * 5, dtype=np.int32).reshape(n_windows, 5)  # row i starts with 5 * i
    return [DataLoader(windows, lbs, r, world, accum, seed) for r in range(world)]


def _rows(batch) -> list[int]:
    return [int(x) // 5 for x in batch[:, 0]]


def _step(loaders, accum: int) -> list[list[int]]:
    """Window ids each rank sees in one optimizer step."""
    return [[w for _ in range(accum) for w in _rows(next(ld))] for ld in loaders]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "PaRO: Partial Redundancy — Optimizer ✓"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)


def test_tokenizer_json_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such tokenizer.json"):
        build_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "tokenizer.json").write_text("{}")
    if importlib.util.find_spec("tokenizers") is None:
        with pytest.raises(RuntimeError, match="needs the 'tokenizers' package"):
            build_tokenizer(str(tmp_path))  # a folder holding tokenizer.json


def test_embedded_corpus_is_shipped():
    files = sorted(CORPUS_DIR.glob("*.txt"))
    assert files and 200_000 < sum(f.stat().st_size for f in files) < 2_500_000
    docs = load_documents("embedded")
    assert len(docs) > 50 and docs == load_documents("embedded")


def test_text_and_jsonl_files(tmp_path):
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "a.md").write_text("first doc\fsecond doc\n")
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    assert load_documents("text", str(tmp_path)) == ["first doc", "second doc", "second file"]
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n")
    assert load_documents("jsonl", str(jl)) == ["one", "two"]
    jl.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: a JSONL record needs a string \"text\" field"):
        load_documents("jsonl", str(jl))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .jsonl/.json files"):
        load_documents("jsonl", str(tmp_path / "empty"))


def test_pack_windows():
    tok = ByteTokenizer()
    stream = tokenize_documents(["ab", "c"], tok)
    assert stream.tolist() == [256, 97, 98, 257, 256, 99, 257]
    w = pack_windows(stream, seq_len=2)
    assert w.tolist() == [[256, 97, 98], [257, 256, 99]]  # the tail is dropped
    with pytest.raises(ValueError, match="fewer than one window"):
        pack_windows(stream, seq_len=10)


def test_ranks_get_disjoint_samples_covering_the_epoch():
    world, accum, lbs, n = 4, 3, 2, 96  # 24 samples per step: an epoch is 4 steps
    loaders = _loaders(world, accum, lbs, n_windows=n)
    seen = []
    for _ in range(4):
        per_rank = _step(loaders, accum)
        flat = [w for r in per_rank for w in r]
        assert len(set(flat)) == len(flat) == 24  # no sample shared between ranks or micro-steps
        seen += flat
    assert sorted(seen) == list(range(n))  # one epoch: every window exactly once
    nxt = _step(loaders, accum)  # the next epoch has another order
    assert [w for r in nxt for w in r] != seen[:24]


def test_deterministic_from_seed_and_independent_of_world_size():
    a = [_step(_loaders(4, 1, seed=3), 1) for _ in range(1)]
    b = [_step(_loaders(4, 1, seed=3), 1) for _ in range(1)]
    c = [_step(_loaders(4, 1, seed=4), 1) for _ in range(1)]
    assert a == b and a != c
    # the same global batch (8 samples) on 4 ranks x 1 or 2 ranks x 2 micro-steps: the same samples
    four = _loaders(4, 1, lbs=2)
    two = _loaders(2, 2, lbs=2)
    for _ in range(5):
        s4 = sorted(w for r in _step(four, 1) for w in r)
        s2 = sorted(w for r in _step(two, 2) for w in r)
        assert s4 == s2


def test_resume_continues_the_stream():
    world, accum = 2, 2
    ref = _loaders(world, accum)
    for _ in range(3):
        _step(ref, accum)
    states = [ld.state_dict() for ld in ref]
    expected = [_step(ref, accum) for _ in range(4)]
    fresh = _loaders(world, accum)
    for ld, st in zip(fresh, states):
        ld.load_state_dict(dict(st))
    assert [_step(fresh, accum) for _ in range(4)] == expected
    # resuming on another world size with the same global batch: the same samples per step
    other = _loaders(1, 4)
    other[0].load_state_dict(dict(states[0]))
    ref2 = _loaders(world, accum)
    for ld, st in zip(ref2, states):
        ld.load_state_dict(dict(st))
    assert sorted(_step(other, 4)[0]) == sorted(w for r in _step(ref2, accum) for w in r)


def test_state_dict_guards():
    ld = _loaders(1, 2)[0]
    next(ld)
    with pytest.raises(RuntimeError, match="step boundary"):
        ld.state_dict()
    next(ld)
    st = ld.state_dict()
    other = _loaders(1, 2, n_windows=50)[0]
    with pytest.raises(ValueError, match="the dataset, tokenizer, seq_len or seed changed"):
        other.load_state_dict(st)


def test_build_dataloader_on_embedded_corpus():
    ld = build_dataloader("embedded", None, ByteTokenizer(), seq_len=64, local_batch_size=4, dp_rank=1, dp_world=2,
                          grad_accum=1, seed=0)
    batch = next(ld)
    assert batch.shape == (4, 65) and batch.dtype.is_floating_point is False
    assert int(batch.max()) < 258
