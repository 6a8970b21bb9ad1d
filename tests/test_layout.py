"""The nested layout agrees with DTensor's placements and its flat copies are inverses."""
import itertools

import pytest
import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode

from paro_fsdp.layout import FlatLayout, placements, tensor_layout
from mesh_coords import MeshCoords
from paro_fsdp.strategy import Level

MESHES = [(2, 2), (2, 4), (4, 2), (8, 8)]
SHAPES = [(64, 3), (16,), (40, 5), (7,), (3, 2), (1,), ()]


def info(g, m, k, l):
    return MeshCoords(g=g, m=m, k=k, l=l)


def full_to_i(lay, full):
    """This rank's intra shard of a FULL buffer: a view of one row."""
    return full.view(lay.info.m, lay.sum_i)[lay.info.l]


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


@pytest.mark.parametrize("g,m,sizes", [(2, 2, (7, 67)), (4, 2, (9, 67)), (3, 8, (7, 67, 11008)), (6, 8, (67, 11008)),
                                       (16, 8, (1000,))])
def test_all_ranks_global_shards_at_once_match_dtensor_rank_by_rank(g, m, sizes):
    """The layout asks DTensor for every rank's global shard in one split (rank by rank is
    quadratic in the world size); the answer is DTensor's per-rank one, nested or not."""
    from paro_fsdp.layout import _dtensor_g_rows, _dtensor_rows

    for d0 in sizes:
        every = _dtensor_g_rows(d0, g, m)
        for k, l in itertools.product(range(g), range(m)):
            assert every[l][k] == _dtensor_rows(d0, g, m, Level.G, k, l), (d0, k, l)


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
        flat_i = full_to_i(lay, full_flat)
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
        # as a chunked all-gather delivers it: column chunks cut anywhere, inside tensors and rows
        cols = expected.view(m, g, sum_g)
        for cuts in ([0, sum_g], [0, 1, sum_g], [0, sum_g // 3, sum_g // 2 + 1, sum_g - 1, sum_g]):
            parts = [(a, b, cols[:, :, a:b].clone()) for a, b in zip(cuts, cuts[1:])]
            for t, x in zip(lay.tensors, fulls):
                out = torch.full((m * t.size_i,), float("nan"))
                lay.copy_out_nested(parts, t, out)
                assert torch.equal(out[: x.numel()].view(x.shape), x), (cuts, t.name)
    assert lays[0, 0].nested_uniform == all(d0 % n == 0 for d0 in (s[0] for s in shapes))


# ---- a large uneven world: a few ops per tensor, not one per rank ------------------------------
@pytest.fixture
def fake_48_ranks():
    """Rank 0 of torch's fake 48-rank process group, on a 6 x 8 ("inter", "intra") mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from paro_fsdp.train.estimate import release_fake_world

    if dist.is_initialized() and dist.get_backend() != "fake":
        pytest.skip("a real process group is running in this process")
    release_fake_world()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=48)
    try:
        yield init_device_mesh("cpu", (6, 8), mesh_dim_names=("inter", "intra"))
    finally:
        dist.destroy_process_group()


class _KernelCount(TorchDispatchMode):
    """ATen ops that are not views (each one is a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_uneven_moves_on_48_ranks_are_a_few_ops_per_tensor(fake_48_ranks):
    """Llama-7B's 11008-row w1 / w3 on 48 GPUs: 11008 = 8 x 1376 and 1376 = 6 x 229.3, so the
    ranks' global shards differ in size and NESTED has padding. Every NESTED <-> whole-tensor /
    FULL move and I <-> [g, sum_g] move is a few ATen ops per tensor (it used to be one copy per
    rank: 48 per tensor), and the values are DTensor's shards, computed here rank by rank."""
    from paro_fsdp.mesh import MeshInfo

    inf = MeshInfo.from_mesh(fake_48_ranks)
    g, m = inf.g, inf.m
    assert (g, m, inf.k, inf.l) == (6, 8, 0, 0)
    shapes = [torch.Size(s) for s in [(11008, 8), (4096, 8), (96, 3), (67,), ()]]  # (96, 3): n divides
    fulls = [torch.randn(s) for s in shapes]
    lay = FlatLayout([tensor_layout(f"t{i}", s, inf) for i, s in enumerate(shapes)], inf)
    assert [t.uniform for t in lay.tensors] == [False, False, True, False, False]
    assert lay.tensors[0].g_rows == [230, 230, 230, 230, 230, 226]  # padded to g_pad = 230

    # the reference: block (l, k) of NESTED is rank (k, l)'s G buffer, each tensor's DTensor shard
    # at its offset in the buffer, zero padding; [g, sum_g] (this rank, l = 0) is NESTED's block l
    expected = torch.zeros(m, g, lay.sum_g)
    for t, x, s in zip(lay.tensors, fulls, shapes):
        rows = x.reshape(t.d0, t.row)
        for k, l in itertools.product(range(g), range(m)):
            lshape, offset = _compute_local_shape_and_global_offset(s or (1,), (g, m), [k, l], placements(Level.G, m))
            piece = rows[offset[0] : offset[0] + lshape[0]].reshape(-1)
            expected[l, k, t.off_g : t.off_g + piece.numel()] = piece
    expected = expected.view(-1)
    full_ref = torch.zeros(m * lay.sum_i)
    for t, x in zip(lay.tensors, fulls):  # FULL: intra shard l of each tensor at row l, padded to c rows
        padded = torch.cat([x.reshape(t.d0, t.row), torch.zeros(m * t.c - t.d0, t.row)])
        full_ref.view(m, lay.sum_i)[:, t.off_i : t.off_i + t.size_i] = padded.view(m, t.size_i)

    per_tensor = len(lay.tensors)
    counts = {}

    def run(name, fn, tensors=per_tensor):
        with _KernelCount() as kc:
            out = fn()
        counts[name] = max(counts.get(name, 0), len(kc.ops) / tensors)
        assert len(kc.ops) <= 4 * tensors, (name, kc.ops)
        return out

    nest = torch.zeros(lay.numel_nested())
    for t, x in zip(lay.tensors, fulls):
        run("copy_in_nested", lambda: lay.copy_in_nested(nest, t, x), 1)
    assert torch.equal(nest, expected)
    got = run("full_to_nested", lambda: lay.full_to_nested(full_ref, torch.zeros(lay.numel_nested())))
    assert torch.equal(got, expected)
    got = run("nested_to_full", lambda: lay.nested_to_full(expected, torch.zeros(lay.numel(Level.N))))
    assert torch.equal(got, full_ref)
    for t, x in zip(lay.tensors, fulls):
        out = torch.full((m * t.size_i,), float("nan"))
        run("copy_out_nested", lambda: lay.copy_out_nested(expected, t, out), 1)
        assert torch.equal(out[: x.numel()].view(x.shape), x)
    inter_ref = expected.view(m, g * lay.sum_g)[inf.l]
    got = run("i_to_inter", lambda: lay.i_to_inter(full_to_i(lay, full_ref), torch.zeros(g * lay.sum_g)))
    assert torch.equal(got, inter_ref)
    got = run("inter_to_i", lambda: lay.inter_to_i(inter_ref, torch.zeros(lay.sum_i)))
    assert torch.equal(got, full_to_i(lay, full_ref))
    print("kernel ops per tensor:", counts)
