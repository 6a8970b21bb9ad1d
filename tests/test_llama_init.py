"""Seeded parameter init fills the tensor it is given, in place, with a generator on that tensor's
device (on a GPU the fill runs there: no whole tensor is built on one CPU thread and copied), and
its CPU values are those of the CPU generator the trainer has always used ($PARO_INIT_RNG=cpu:
those values on any device)."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from paro_fsdp.models.llama import Llama, flavor, rope_tables

ARGS = flavor("debug")


def _reference(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The historic seeded values: a CPU generator from (seed, name), fp32 normal of std 0.02
    (scaled down for the residual projections)."""
    std = 0.02 / (math.sqrt(2 * ARGS.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _meta_model() -> Llama:
    with torch.device("meta"):
        return Llama(ARGS)


def test_seeded_values_match_the_cpu_reference_for_any_target():
    model = _meta_model()
    for name, p in model.named_parameters():
        t = torch.empty(p.shape)
        model.init_param(name, t, seed=3)
        if p.dim() == 1:
            assert torch.equal(t, torch.ones(p.shape)), name
            continue
        want = _reference(name, p.shape, 3)
        assert torch.equal(t, want), name
        half = torch.empty(p.shape, dtype=torch.bfloat16)  # cast from the fp32 values
        model.init_param(name, half, seed=3)
        assert torch.equal(half, want.bfloat16()), name
        transposed = torch.empty(tuple(reversed(p.shape))).t()  # a strided target gets the same values
        model.init_param(name, transposed, seed=3)
        assert torch.equal(transposed, want), name


def test_fills_in_place_with_a_generator_on_the_tensors_device(monkeypatch):
    model = _meta_model()
    devices, temporaries = [], []
    real_generator, real_empty = torch.Generator, torch.empty

    def generator(*args, **kwargs):
        devices.append(torch.device(kwargs.get("device", args[0] if args else "cpu")))
        return real_generator(*args, **kwargs)

    def empty(*args, **kwargs):
        temporaries.append(kwargs.get("device"))
        return real_empty(*args, **kwargs)

    target = real_empty(ARGS.vocab_size, ARGS.dim)
    ptr = target.data_ptr()
    monkeypatch.setattr(torch, "Generator", generator)
    monkeypatch.setattr(torch, "empty", empty)
    model.init_param("output.weight", target, seed=3)
    assert devices == [target.device] and temporaries == []  # fp32 contiguous: filled where it lies
    assert target.data_ptr() == ptr and target.std().item() > 0.01
    model.init_param("output.weight", real_empty(ARGS.vocab_size, ARGS.dim, dtype=torch.bfloat16), seed=3)
    assert temporaries == [target.device]  # a cast target: the fp32 values made on its device


def test_the_same_values_in_any_order_and_model():
    a, b = _meta_model(), _meta_model()
    names = [n for n, p in a.named_parameters() if p.dim() == 2]
    got_a = {}
    for n in names:
        got_a[n] = torch.empty(dict(a.named_parameters())[n].shape)
        a.init_param(n, got_a[n], seed=11)
    for n in reversed(names):
        t = torch.empty(got_a[n].shape)
        b.init_param(n, t, seed=11)
        assert torch.equal(t, got_a[n]), n


def test_rope_tables_on_the_target_device():
    model = _meta_model()
    model.init_buffers(torch.device("cpu"))
    cos, sin = rope_tables(ARGS.dim // ARGS.n_heads, ARGS.max_seq_len, ARGS.rope_theta)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    meta_cos, _ = rope_tables(ARGS.dim // ARGS.n_heads, 8, ARGS.rope_theta, device=torch.device("meta"))
    assert meta_cos.is_meta  # computed where asked, not on the CPU and moved


def test_cpu_rng_on_request_and_bad_values(monkeypatch):
    model = _meta_model()
    devices = []
    real_generator = torch.Generator

    def generator(*args, **kwargs):
        devices.append(torch.device(kwargs.get("device", args[0] if args else "cpu")))
        return real_generator(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", generator)
    monkeypatch.setenv("PARO_INIT_RNG", "cpu")
    t = torch.empty(ARGS.dim, ARGS.dim)
    model.init_param("layers.0.attention.wq.weight", t, seed=5)
    assert devices == [torch.device("cpu")]
    assert torch.equal(t, _reference("layers.0.attention.wq.weight", t.shape, 5))
    monkeypatch.setenv("PARO_INIT_RNG", "gpu")
    with pytest.raises(ValueError, match=r"PARO_INIT_RNG.*valid: device .* cpu"):
        model.init_param("layers.0.attention.wq.weight", t, seed=5)
