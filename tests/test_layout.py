"""The nested layout agrees with DTensor's placements and its flat copies are inverses."""
import itertools

import pytest
import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from paro_fsdp.layout import FlatLayout, placements, tensor_layout
from paro_fsdp.mesh import MeshInfo
from paro_fsdp.strategy import Level

MESHES = [(2, 2), (2, 4), (4, 2), (8, 8)]
SHAPES = [(64, 3), (16,), (40, 5), (7,), (3, 2), (1,), ()]


def info(g, m, k, l):
    return MeshInfo(mesh=None, g=g, m=m, k=k, l=l, group_names={})


def nested(d0, g, m):
    try:
        for k, l in itertools.product(range(g), range(m)):
            tensor_layout("t", torch.Size([d0]), info(g, m, k, l))
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("g,m", MESHES)
@pytest.mark.parametrize("shape", SHAPES)
def test_local_slices_match_dtensor(g, m, shape):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    if not nested(shape[0] if shape else 1, g, m):
        pytest.skip("layout not nested for this size; paro_shard rejects it with a clear error")
    for k, l in itertools.product(range(g), range(m)):
        t = tensor_layout("t", full.shape, info(g, m, k, l))
        for level in Level:
            local = t.local_slice(full, level, k)
            if len(shape) == 0:
                continue
            lshape, offset = _compute_local_shape_and_global_offset(shape, (g, m), [k, l], placements(level, m))
            assert tuple(local.shape) == tuple(lshape)
            if local.numel():
                assert torch.equal(local, full.narrow(0, offset[0], lshape[0]))


def test_non_nested_size_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="without level G"):
        for k, l in itertools.product(range(4), range(2)):
            tensor_layout("odd", torch.Size([9]), info(4, 2, k, l))


@pytest.mark.parametrize("g,m", MESHES)
def test_flat_round_trips(g, m):
    shapes = [torch.Size(s) for s in [(16, 3), (8,), (24, 2)] + ([(5, 2)] if nested(5, g, m) else [])]
    fulls = [torch.randn(s) for s in shapes]
    for k, l in itertools.product(range(g), range(m)):
        inf = info(g, m, k, l)
        lay = FlatLayout([tensor_layout(f"t{i}", s, inf) for i, s in enumerate(shapes)], inf)
        full_flat = lay.new(Level.N, torch.float32, torch.device("cpu"))
        for t, x in zip(lay.tensors, fulls):
            lay.copy_in(full_flat, t, x)
        flat_i = lay.full_to_i(full_flat)
        for t, x in zip(lay.tensors, fulls):
            assert torch.equal(lay.local_view(flat_i, t, Level.I), t.local_slice(x, Level.I, k))
            out = torch.empty(m * t.size_i)
            lay.copy_out(full_flat, t, out)
            assert torch.equal(out[: x.numel()].view(x.shape), x)
        flat_g = lay.i_to_g(flat_i, lay.new(Level.G, torch.float32, torch.device("cpu")))
        for t, x in zip(lay.tensors, fulls):
            assert torch.equal(lay.local_view(flat_g, t, Level.G), t.local_slice(x, Level.G, k))
        inter = lay.i_to_inter(flat_i, torch.empty(g * lay.sum_g))
        back = lay.inter_to_i(inter, torch.zeros(lay.sum_i))
        for t, x in zip(lay.tensors, fulls):
            assert torch.equal(lay.local_view(back, t, Level.I), t.local_slice(x, Level.I, k))


@pytest.mark.parametrize("g,m", MESHES)
def test_nested_buffers_hold_every_ranks_g_buffer(g, m):
    """NESTED block (l, k) is rank (k, l)'s G buffer, for uneven sizes too (where ranks of
    different intra index have different global shards): the PaRO-CC global collectives move
    these buffers, so every rank's G buffer must have one size and NESTED <-> FULL / whole
    tensors must use every intra index's layout."""
    shapes = [torch.Size(s) for s in [(16, 3), (8,)] + [(d,) for d in (5, 9, 1, 7, 13) if nested(d, g, m)] + [(24, 2)]]
    fulls = [torch.randn(s) for s in shapes]
    n = g * m
    lays = {}
    for k, l in itertools.product(range(g), range(m)):
        inf = info(g, m, k, l)
        lays[k, l] = FlatLayout([tensor_layout(f"t{i}", s, inf) for i, s in enumerate(shapes)], inf)
    assert len({lay.sum_g for lay in lays.values()}) == 1  # one G size on every rank
    sum_g = lays[0, 0].sum_g
    expected = torch.zeros(n * sum_g)
    for (k, l), lay in lays.items():  # rank (k, l)'s G buffer at block l * g + k
        block = expected[(l * g + k) * sum_g : (l * g + k + 1) * sum_g]
        for t, x in zip(lay.tensors, fulls):
            lay.local_view(block, t, Level.G).copy_(t.local_slice(x, Level.G, k))
    for lay in lays.values():  # every rank computes the same NESTED buffer
        nest = torch.zeros(lay.numel_nested())
        full_flat = lay.new(Level.N, torch.float32, torch.device("cpu"))
        for t, x in zip(lay.tensors, fulls):
            lay.copy_in_nested(nest, t, x)
            lay.copy_in(full_flat, t, x)
        assert torch.equal(nest, expected)
        assert torch.equal(lay.full_to_nested(full_flat, torch.zeros(lay.numel_nested())), expected)
        back = lay.nested_to_full(expected, torch.zeros(lay.numel(Level.N)))
        assert torch.equal(back, full_flat)
        for t, x in zip(lay.tensors, fulls):
            out = torch.empty(m * t.size_i)
            lay.copy_out_nested(expected, t, out)
            assert torch.equal(out[: x.numel()].view(x.shape), x)
    assert lays[0, 0].nested_uniform == all(d0 % n == 0 for d0 in (s[0] for s in shapes))
