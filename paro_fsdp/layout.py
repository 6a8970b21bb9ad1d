"""Where each tensor's rows live at each level, and the flat buffers one collective moves.

Every tensor is sharded on dim 0 with DTensor's own semantics, so the local shards are exactly
the ``_local_tensor`` of DTensors with placements N = (Replicate, Replicate),
I = (Replicate, Shard(0)), G = (_StridedShard(0, split_factor=m), Shard(0)). The G shard of rank
(k, l) is a sub-slice of its intra shard (the spec's nesting rule), which is what makes
I -> G a local slice and G -> I one inter all-gather.

A group of tensors moves as one flat buffer per level:
  FULL  [m, sum_i]   every tensor padded to m * c rows (c = ceil(d0 / m)), rank-major: the
                     output of an intra all-gather and the input of an intra reduce-scatter;
  I     [sum_i]      this rank's intra shard of every tensor, padded to c rows;
  G     [sum_g]      this rank's global shard of every tensor, padded to the largest global
                     shard of any rank, so every rank's G buffer has the same size (inter
                     rings and the hierarchical global collectives both need that);
  NESTED [m, g, sum_g] every rank's G buffer, block (l, k) = rank (k, l)'s: the output of a
                     PaRO-CC global all-gather and the input of its global reduce-scatter
                     (``paro_cc``, order "nested"). Block (l, k) holds rows of intra shard l, so
                     NESTED <-> FULL / whole tensors needs every intra index's G layout
                     (``g_starts_all`` / ``g_rows_all``), not only this rank's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from .mesh import MeshInfo
from .strategy import Level


def placements(level: Level, m: int) -> tuple:
    return {
        Level.N: (Replicate(), Replicate()),
        Level.I: (Replicate(), Shard(0)),
        Level.G: (_StridedShard(0, split_factor=m), Shard(0)),
    }[level]


def _rows(d0: int, info: MeshInfo, level: Level, k: int, l: int) -> tuple[int, int]:  # noqa: E741
    """(first row, number of rows) of rank (k, l)'s shard, as DTensor defines it."""
    return _dtensor_rows(d0, info.g, info.m, level, k, l)


@functools.lru_cache(maxsize=None)
def _dtensor_rows(d0: int, g: int, m: int, level: Level, k: int, l: int) -> tuple[int, int]:  # noqa: E741
    # Pure shape metadata, but DTensor computes it with small tensors: step out of any active
    # FakeTensorMode (tools/estimate.py shards a fake 7B model), and cache, as layers repeat shapes.
    with unset_fake_temporarily():
        shape, offset = _compute_local_shape_and_global_offset((d0,), (g, m), [k, l], placements(level, m))
    return (offset[0] if shape[0] else 0), shape[0]


@dataclass
class TensorLayout:
    name: str
    shape: torch.Size
    d0: int  # rows (dim 0; 1 for a scalar)
    row: int  # elements per row
    c: int  # padded rows of one intra shard
    i_start: int  # first global row of this rank's intra shard
    i_rows: int
    g_starts: list[int]  # per group index k: first row of (k, l)'s shard inside intra shard l
    g_rows: list[int]
    g_pad: int  # padded rows of a global shard: the largest of any rank
    g_starts_all: list[list[int]]  # [l][k]: g_starts of intra index l (g_starts is row info.l)
    g_rows_all: list[list[int]]  # [l][k]: g_rows of intra index l
    off_i: int = 0  # element offset in the I flat buffer
    off_g: int = 0  # element offset in the G flat buffer

    def local_shape(self, level: Level, k: int) -> torch.Size:
        rows = {Level.N: self.d0, Level.I: self.i_rows, Level.G: self.g_rows[k]}[level]
        if len(self.shape) == 0:
            return torch.Size([]) if rows else torch.Size([0])
        return torch.Size([rows, *self.shape[1:]])

    def local_slice(self, full: torch.Tensor, level: Level, k: int) -> torch.Tensor:
        """This rank's shard of ``full`` (the whole tensor) at ``level``."""
        if level == Level.N:
            return full
        flat = full.reshape(self.d0, self.row)
        start, rows = self.i_start, self.i_rows
        if level == Level.G:
            start, rows = start + self.g_starts[k], self.g_rows[k]
        return flat[start : start + rows].reshape(self.local_shape(level, k))

    @property
    def size_i(self) -> int:
        return self.c * self.row

    @property
    def size_g(self) -> int:
        return self.g_pad * self.row

    @property
    def uniform(self) -> bool:
        """Every rank's global shard has g_pad rows at k * g_pad of its intra shard (so
        d0 = m * c = n * g_pad): NESTED <-> FULL is one strided copy and has no padding."""
        g = len(self.g_rows)
        return all(starts == [k * self.g_pad for k in range(g)] and rows == [self.g_pad] * g
                   for starts, rows in zip(self.g_starts_all, self.g_rows_all))


def tensor_layout(name: str, shape: torch.Size, info: MeshInfo) -> TensorLayout:
    d0 = shape[0] if len(shape) else 1
    numel = 1
    for s in shape:
        numel *= s
    row = numel // d0 if d0 else 0
    # every intra index's G layout (checked the same way on every rank, so all ranks agree on
    # whether a size nests): the hierarchical global collectives move all of them
    starts_all, rows_all = [], []
    for l in range(info.m):  # noqa: E741
        i_start, i_rows = _rows(d0, info, Level.I, 0, l)
        g_starts, g_rows = [], []
        cursor = i_start
        for k in range(info.g):
            start, rows = _rows(d0, info, Level.G, k, l)
            if rows and start != cursor:
                raise ValueError(
                    f"parameter {name!r} (dim 0 = {d0}) cannot be sharded globally on a "
                    f"{info.g}x{info.m} mesh: DTensor's strided layout of it is not nested in the intra "
                    f"shard. Give it a strategy without level G (policy={{'{name}': 'III', ...}}) or "
                    f"make dim 0 divisible by the world size {info.n}."
                )
            g_starts.append(cursor - i_start)
            g_rows.append(rows)
            cursor += rows
        if cursor != i_start + i_rows:
            raise ValueError(f"parameter {name!r}: global shards do not tile its intra shard on this mesh")
        starts_all.append(g_starts)
        rows_all.append(g_rows)
    i_start, i_rows = _rows(d0, info, Level.I, 0, info.l)
    c = -(-d0 // info.m)
    g_pad = max(max(r) for r in rows_all)
    return TensorLayout(name, shape, d0, row, c, i_start, i_rows, starts_all[info.l], rows_all[info.l], g_pad,
                        starts_all, rows_all)


class FlatLayout:
    """The flat FULL / I / G buffers of a list of tensors, and the copies between them."""

    def __init__(self, tensors: list[TensorLayout], info: MeshInfo) -> None:
        self.tensors = tensors
        self.info = info
        off_i = off_g = 0
        for t in tensors:
            t.off_i, t.off_g = off_i, off_g
            off_i += t.size_i
            off_g += t.size_g
        self.sum_i, self.sum_g = off_i, off_g
        # when every global shard has g_pad rows at k * g_pad, I <-> G is one strided copy per tensor
        self._uniform = all(
            t.g_starts == [k * t.g_pad for k in range(info.g)] and t.g_rows == [t.g_pad] * info.g for t in tensors
        )

    def numel(self, level: Level) -> int:
        return {Level.N: self.info.m * self.sum_i, Level.I: self.sum_i, Level.G: self.sum_g}[level]

    def new(self, level: Level, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.numel(level), dtype=dtype, device=device)

    # views of real rows inside a flat buffer ---------------------------------------------
    def local_view(self, flat: torch.Tensor, t: TensorLayout, level: Level) -> torch.Tensor:
        """Tensor ``t``'s real rows inside the I or G flat buffer (a view, no copy)."""
        k = self.info.k
        if level == Level.I:
            piece = flat[t.off_i : t.off_i + t.i_rows * t.row]
        elif level == Level.G:
            piece = flat[t.off_g : t.off_g + t.g_rows[k] * t.row]
        else:
            raise ValueError("FULL buffers are rank-major; use copy_out / copy_in")
        return piece.view(t.local_shape(level, k))

    # FULL <-> whole tensors ---------------------------------------------------------------
    def copy_out(self, full: torch.Tensor, t: TensorLayout, dst: torch.Tensor) -> None:
        """Write tensor ``t`` from the FULL buffer into ``dst`` (at least m * c rows, padded)."""
        src = full.view(self.info.m, self.sum_i)[:, t.off_i : t.off_i + t.size_i]
        dst.view(self.info.m, t.size_i).copy_(src)

    def copy_in(self, full: torch.Tensor, t: TensorLayout, src: torch.Tensor, add: bool = False) -> None:
        """Write (or add) the whole tensor ``src`` into the FULL buffer, zero in the padding rows."""
        m, c, row = self.info.m, t.c, t.row
        dst = full.view(m, self.sum_i)[:, t.off_i : t.off_i + t.size_i].view(m, c, row)
        src = src.reshape(t.d0, row)
        if t.d0 != m * c:
            src = torch.cat([src, src.new_zeros(m * c - t.d0, row)])
        src = src.view(m, c, row)
        dst.add_(src) if add else dst.copy_(src)

    # I <-> G ------------------------------------------------------------------------------
    def i_to_g(self, flat_i: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """This rank's global shard is a slice of its intra shard: a local copy."""
        k = self.info.k
        for t in self.tensors:
            n = t.g_rows[k] * t.row
            s = t.off_i + t.g_starts[k] * t.row
            out[t.off_g : t.off_g + n].copy_(flat_i[s : s + n])
        return out

    def i_to_inter(self, flat_i: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Lay the intra shard out as [g, sum_g]: the input of an inter reduce-scatter."""
        g = self.info.g
        out2 = out.view(g, self.sum_g)
        for t in self.tensors:
            if self._uniform:
                out2[:, t.off_g : t.off_g + t.size_g].copy_(flat_i[t.off_i : t.off_i + g * t.size_g].view(g, t.size_g))
                continue
            for k in range(g):
                n = t.g_rows[k] * t.row
                s = t.off_i + t.g_starts[k] * t.row
                out2[k, t.off_g : t.off_g + n].copy_(flat_i[s : s + n])
        return out

    def inter_to_i(self, gathered: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Inverse of ``i_to_inter``: the output of an inter all-gather back to the I buffer."""
        g = self.info.g
        src2 = gathered.view(g, self.sum_g)
        for t in self.tensors:
            if self._uniform:
                out[t.off_i : t.off_i + g * t.size_g].view(g, t.size_g).copy_(src2[:, t.off_g : t.off_g + t.size_g])
                continue
            for k in range(g):
                n = t.g_rows[k] * t.row
                s = t.off_i + t.g_starts[k] * t.row
                out[s : s + n].copy_(src2[k, t.off_g : t.off_g + n])
        return out

    # NESTED <-> FULL / whole tensors (the PaRO-CC global collectives) ---------------------
    @property
    def nested_uniform(self) -> bool:
        """NESTED has no padding and maps to FULL by strided copies (sizes n divides)."""
        return all(t.uniform for t in self.tensors)

    def numel_nested(self) -> int:
        return self.info.n * self.sum_g

    def _nested_pairs(self, nested: torch.Tensor, base: torch.Tensor, t: TensorLayout):
        """Matching (NESTED piece, whole-tensor piece) views of tensor ``t``: ``base`` is its
        [m, c * row] rows (a whole padded tensor, or its columns of a FULL buffer)."""
        m, g = self.info.m, self.info.g
        part = nested.view(m, g, self.sum_g)[:, :, t.off_g : t.off_g + t.size_g]
        if t.uniform:
            yield part, base.view(m, g, t.size_g)
            return
        for l in range(m):  # noqa: E741
            for k in range(g):
                rows, start = t.g_rows_all[l][k], t.g_starts_all[l][k]
                if rows:
                    yield part[l, k, : rows * t.row], base[l, start * t.row : (start + rows) * t.row]

    def _full_cols(self, full: torch.Tensor, t: TensorLayout) -> torch.Tensor:
        return full.view(self.info.m, self.sum_i)[:, t.off_i : t.off_i + t.size_i]

    def copy_out_nested(self, nested: torch.Tensor, t: TensorLayout, dst: torch.Tensor) -> None:
        """Write tensor ``t`` from a NESTED buffer into ``dst`` (at least m * c rows, padded)."""
        for src, out in self._nested_pairs(nested, dst[: self.info.m * t.size_i].view(self.info.m, t.size_i), t):
            out.copy_(src)

    def copy_in_nested(self, nested: torch.Tensor, t: TensorLayout, src: torch.Tensor) -> None:
        """Write the whole tensor ``src`` into a NESTED buffer (its padding is left as it is)."""
        m, c, row = self.info.m, t.c, t.row
        src = src.reshape(t.d0, row)
        if t.d0 != m * c:
            src = torch.cat([src, src.new_zeros(m * c - t.d0, row)])
        for dst, piece in self._nested_pairs(nested, src.view(m, t.size_i), t):
            dst.copy_(piece)

    def full_to_nested(self, full: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """FULL [m, sum_i] -> NESTED [m, g, sum_g] (``out`` zeroed by the caller where
        ``nested_uniform`` is false, if its padding matters)."""
        for t in self.tensors:
            for dst, src in self._nested_pairs(out, self._full_cols(full, t), t):
                dst.copy_(src)
        return out

    def nested_to_full(self, nested: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """NESTED [m, g, sum_g] -> FULL [m, sum_i] (padding rows of ``out`` are not written)."""
        for t in self.tensors:
            for src, dst in self._nested_pairs(nested, self._full_cols(out, t), t):
                dst.copy_(src)
        return out

    def full_to_i(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's intra shard of a FULL buffer: a view of one row."""
        return full.view(self.info.m, self.sum_i)[self.info.l]
