"""Where each tensor's rows live at each level, and the flat buffers one collective moves.

Shards are DTensor's own (``placements``), so the G shard of rank (k, l) is a sub-slice of its
intra shard (the method's nesting rule): I -> G is a local slice, G -> I one inter all-gather.

A group of tensors moves as one flat buffer per level:
  FULL  [m, sum_i]   every tensor padded to m * c rows (c = ceil(d0 / m)), rank-major;
  I     [sum_i]      this rank's intra shard of every tensor, padded to c rows;
  G     [sum_g]      this rank's global shard, padded to the largest of any rank (inter rings and
                     the hierarchical collectives need one size everywhere);
  NESTED [m, g, sum_g] every rank's G buffer, block (l, k) = rank (k, l)'s: what PaRO-CC's global
                     collectives move. Block (l, k) holds rows of intra shard l, so NESTED <-> FULL
                     needs every intra index's G layout.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from .mesh import Coords, MeshInfo, mesh_device
from .strategy import Level

#: (a, b, piece): columns a..b of every rank's global shard, piece shaped [m, g, b - a] (a NESTED
#: buffer is [m, g, sum_g]): how a chunked PaRO-CC all-gather delivers it (``copy_out_nested``)
NestedPart = tuple[int, int, torch.Tensor]


def placements(level: Level, m: int) -> tuple:
    return {
        Level.N: (Replicate(), Replicate()),
        Level.I: (Replicate(), Shard(0)),
        Level.G: (_StridedShard(0, split_factor=m), Shard(0)),
    }[level]


def param_placements(level: Level, info: MeshInfo) -> tuple:
    """A parameter's placements on ``info.param_mesh``: on a 1D mesh (one group) the intra ones."""
    full = placements(level, info.m)
    return full[1:] if info.param_mesh is not None and info.param_mesh.ndim == 1 else full


@functools.lru_cache(maxsize=None)
def _dtensor_rows(d0: int, g: int, m: int, level: Level, k: int, l: int) -> tuple[int, int]:  # noqa: E741
    """(first row, number of rows) of rank (k, l)'s shard, as DTensor defines it. Out of any
    FakeTensorMode (DTensor computes it with small tensors) and cached, as layers repeat shapes."""
    with unset_fake_temporarily():
        shape, offset = _compute_local_shape_and_global_offset((d0,), (g, m), [k, l], placements(level, m))
    return (offset[0] if shape[0] else 0), shape[0]


@functools.lru_cache(maxsize=None)
def _dtensor_g_rows(d0: int, g: int, m: int) -> list[list[tuple[int, int]]]:
    """[l][k]: ``_dtensor_rows(..., Level.G, k, l)`` for every rank at once (rank by rank is
    quadratic in the world size)."""
    strided, intra = placements(Level.G, m)
    out: list[list[tuple[int, int]]] = [[(0, 0)] * g for _ in range(m)]
    with unset_fake_temporarily(), torch.inference_mode(False):
        for k, piece in enumerate(strided._split_tensor(torch.arange(d0), g, with_padding=False)[0]):
            for l, rows in enumerate(intra._split_tensor(piece, m, with_padding=False)[0]):  # noqa: E741
                out[l][k] = (int(rows[0]) if rows.numel() else 0, rows.numel())
    return out


class _Nesting:
    """Every intra index's G layout of a tensor of ``d0`` rows on a (g, m) mesh (one per shape), and,
    where the world size does not divide d0, the row indices of its NESTED <-> whole moves: NESTED
    rows as [m * g, g_pad] (``mg`` = l * g + k, ``r``), the padded whole tensor's as [m, c] (``bl``,
    ``bj``); entry q of each is row q of the whole tensor. CPU int64, made outside any FakeTensorMode."""

    def __init__(self, d0: int, g: int, m: int) -> None:
        self.d0, self.g, self.m = d0, g, m
        self.error: Optional[str] = None  # "strided" (not nested) or "tiles" (shards do not tile)
        starts_all, rows_all, i_rows_all = [], [], []
        shards = _dtensor_g_rows(d0, g, m)
        for l in range(m):  # noqa: E741
            i_start, i_rows = _dtensor_rows(d0, g, m, Level.I, 0, l)
            g_starts, g_rows = [], []
            cursor = i_start
            for k in range(g):
                start, rows = shards[l][k]
                if rows and start != cursor:
                    self.error = "strided"
                    return
                g_starts.append(cursor - i_start)
                g_rows.append(rows)
                cursor += rows
            if cursor != i_start + i_rows:
                self.error = "tiles"
                return
            starts_all.append(g_starts)
            rows_all.append(g_rows)
            i_rows_all.append(i_rows)
        self.starts_all, self.rows_all, self.i_rows_all = starts_all, rows_all, i_rows_all
        self.c = -(-d0 // m)
        self.g_pad = max(max(r) for r in rows_all)
        # per intra index l: its global shards are g_pad rows at k * g_pad (I <-> [g, sum_g] strided)
        even = [k * self.g_pad for k in range(g)]
        self.uniform_l = [s == even and r == [self.g_pad] * g for s, r in zip(starts_all, rows_all)]
        self.uniform = all(self.uniform_l)
        self._dev: dict[tuple[str, int, torch.device], torch.Tensor] = {}
        self._inter: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.uniform:
            return
        mg, rr, base, self.first = [], [], [], []  # first[l]: entry of intra shard l's first row
        for l in range(m):  # noqa: E741
            self.first.append(len(base))
            for k in range(g):
                rows, start = rows_all[l][k], starts_all[l][k]
                mg.extend([l * g + k] * rows)
                rr.extend(range(rows))
                base.extend(range(l * self.c + start, l * self.c + start + rows))
        if base != list(range(d0)):  # intra shard l at row l * c: what copy_in's padding assumes too
            raise AssertionError(f"intra shards of {d0} rows on {m} ranks are not chunks of {self.c} rows")
        with unset_fake_temporarily(), torch.inference_mode(False):
            self.mg, self.r, rows_q = (torch.tensor(x, dtype=torch.long) for x in (mg, rr, base))
            self.bl, self.bj = rows_q // self.c, rows_q % self.c

    def inter(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
        """(k, r) of each row of intra shard ``l``, in order (I <-> [g, sum_g] of rank l)."""
        if l not in self._inter:
            with unset_fake_temporarily(), torch.inference_mode(False):
                sl = slice(self.first[l], self.first[l] + self.i_rows_all[l])
                self._inter[l] = (self.mg[sl] - l * self.g, self.r[sl].clone())
        return self._inter[l]

    def _cpu(self, name: str, l: int) -> torch.Tensor:  # noqa: E741
        return self.inter(l)[("k", "r").index(name)] if l >= 0 else getattr(self, name)

    def to_device(self, device: torch.device, *names: str, l: int = -1) -> None:  # noqa: E741
        """Copied now, outside any trace: a graph reads them as inputs instead of copying each call."""
        with unset_fake_temporarily(), torch.inference_mode(False):
            for n in names:
                if (n, l, device) not in self._dev:
                    self._dev[n, l, device] = self._cpu(n, l).to(device)

    def on(self, like: torch.Tensor, *names: str, l: int = -1) -> list[torch.Tensor]:  # noqa: E741
        """The index tensors ``names`` (attributes, or "k" / "r" of ``inter(l)``) on ``like``'s
        device: ``to_device``'s copies, fake for fake buffers."""
        if torch.compiler.is_compiling():
            made = [self._dev.get((n, l, like.device)) for n in names]
            return made if all(x is not None for x in made) else [self._cpu(n, l).to(like.device) for n in names]
        if isinstance(like, FakeTensor):
            return [like.fake_mode.from_tensor(self._cpu(n, l)).to(like.device) for n in names]
        if like.device.type == "cpu":
            return [self._cpu(n, l) for n in names]
        self.to_device(like.device, *names, l=l)
        return [self._dev[n, l, like.device] for n in names]


@functools.lru_cache(maxsize=None)
def _nesting(d0: int, g: int, m: int) -> _Nesting:
    return _Nesting(d0, g, m)


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
    off_i: int = 0  # element offset in the I flat buffer
    off_g: int = 0  # element offset in the G flat buffer
    l: int = 0  # this rank's intra index  # noqa: E741
    nest: _Nesting = field(default=None, repr=False, compare=False)  # shared per (d0, g, m)

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
        """d0 = m * c = n * g_pad: NESTED <-> FULL is one strided copy without padding."""
        return self.nest.uniform

    @property
    def uniform_here(self) -> bool:
        """This rank's intra shard is g global shards of g_pad rows: I <-> [g, sum_g] is strided."""
        return self.nest.uniform_l[self.l]


def tensor_layout(name: str, shape: torch.Size, info: Coords) -> TensorLayout:
    d0 = shape[0] if len(shape) else 1
    row = math.prod(shape) // d0 if d0 else 0
    nest = _nesting(d0, info.g, info.m)  # every intra index's, so all ranks agree on whether it nests
    if nest.error == "strided":
        raise ValueError(f"parameter {name!r} (dim 0 = {d0}) cannot be sharded globally on a {info.g}x{info.m} "
                         f"mesh: DTensor's strided layout of it is not nested in the intra shard. Give it a strategy "
                         f"without level G (policy={{'{name}': 'III', ...}}) or make dim 0 divisible by the world "
                         f"size {info.n}.")
    if nest.error == "tiles":
        raise ValueError(f"parameter {name!r}: global shards do not tile its intra shard on this mesh")
    i_start, i_rows = _dtensor_rows(d0, info.g, info.m, Level.I, 0, info.l)
    l = info.l  # noqa: E741
    return TensorLayout(name, shape, d0, row, nest.c, i_start, i_rows, nest.starts_all[l], nest.rows_all[l],
                        nest.g_pad, l=l, nest=nest)


class FlatLayout:
    """The flat FULL / I / G buffers of a list of tensors, and the copies between them. ``device``
    (default: the mesh's, CPU for bare coordinates) gets the uneven tensors' row indices once, here."""

    def __init__(self, tensors: list[TensorLayout], info: Coords, device: torch.device | str | None = None) -> None:
        self.tensors = tensors
        self.info = info
        self.device = torch.device(device) if device is not None else \
            mesh_device(info) if isinstance(info, MeshInfo) else torch.device("cpu")
        off_i = off_g = 0
        for t in tensors:
            t.off_i, t.off_g = off_i, off_g
            off_i += t.size_i
            off_g += t.size_g
        self.sum_i, self.sum_g = off_i, off_g
        #: NESTED has no padding and maps to FULL by strided copies (sizes n divides)
        self.nested_uniform = all(t.uniform for t in tensors)
        for t in tensors:  # the row indices of uneven tensors, on the device before any trace
            if not t.uniform:
                t.nest.to_device(self.device, "mg", "r", "bl", "bj")
            if not t.uniform_here:
                t.nest.to_device(self.device, "k", "r", l=t.l)

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
    def full_rows(self, full: torch.Tensor, t: TensorLayout) -> torch.Tensor:
        """Tensor ``t``'s padded rows in the FULL buffer, a [m, size_i] view (row-major: the whole tensor)."""
        return full.view(self.info.m, self.sum_i)[:, t.off_i : t.off_i + t.size_i]

    def copy_out(self, full: torch.Tensor, t: TensorLayout, dst: torch.Tensor) -> None:
        """Write tensor ``t`` from the FULL buffer into ``dst`` (at least m * c rows, padded)."""
        dst.view(self.info.m, t.size_i).copy_(self.full_rows(full, t))

    def copy_in(self, full: torch.Tensor, t: TensorLayout, src: torch.Tensor, add: bool = False) -> None:
        """Write (or add) the whole tensor ``src`` into the FULL buffer, zero in the padding rows."""
        m, c, row = self.info.m, t.c, t.row
        dst = self.full_rows(full, t).view(m, c, row)
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

    def _inter_cols(self, buf: torch.Tensor, t: TensorLayout) -> torch.Tensor:
        """Tensor ``t``'s columns of a [g, sum_g] buffer as [g, g_pad, row]."""
        return buf.view(self.info.g, self.sum_g)[:, t.off_g : t.off_g + t.size_g].view(self.info.g, t.g_pad, t.row)

    def i_to_inter(self, flat_i: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Lay the intra shard out as [g, sum_g]: the input of an inter reduce-scatter."""
        g = self.info.g
        out2 = out.view(g, self.sum_g)
        for t in self.tensors:
            if t.uniform_here:
                out2[:, t.off_g : t.off_g + t.size_g].copy_(flat_i[t.off_i : t.off_i + g * t.size_g].view(g, t.size_g))
                continue
            k, r = t.nest.on(out, "k", "r", l=t.l)  # one scatter of the intra shard's rows
            src = flat_i[t.off_i : t.off_i + t.i_rows * t.row].view(t.i_rows, t.row)
            self._inter_cols(out, t).index_put_((k, r), src.to(out.dtype))
        return out

    def inter_to_i(self, gathered: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Inverse of ``i_to_inter``: the output of an inter all-gather back to the I buffer."""
        g = self.info.g
        src2 = gathered.view(g, self.sum_g)
        for t in self.tensors:
            if t.uniform_here:
                out[t.off_i : t.off_i + g * t.size_g].view(g, t.size_g).copy_(src2[:, t.off_g : t.off_g + t.size_g])
                continue
            k, r = t.nest.on(gathered, "k", "r", l=t.l)  # one gather of the intra shard's rows
            out[t.off_i : t.off_i + t.i_rows * t.row].view(t.i_rows, t.row).copy_(self._inter_cols(gathered, t)[k, r])
        return out

    # NESTED <-> FULL / whole tensors (the PaRO-CC global collectives) ---------------------
    def numel_nested(self) -> int:
        return self.info.n * self.sum_g

    def _nested_cols(self, nested: torch.Tensor, t: TensorLayout) -> torch.Tensor:
        """Tensor ``t``'s columns of a NESTED buffer: [m, g, size_g] if uniform, else
        [m * g, g_pad, row] (rows of every rank's global shard, padded to g_pad)."""
        m, g = self.info.m, self.info.g
        if t.uniform:
            return nested.view(m, g, self.sum_g)[:, :, t.off_g : t.off_g + t.size_g]
        return nested.view(m * g, self.sum_g)[:, t.off_g : t.off_g + t.size_g].view(m * g, t.g_pad, t.row)

    def nested_rows(self, nested: torch.Tensor, t: TensorLayout) -> torch.Tensor:
        """Tensor ``t``'s rows from a NESTED buffer (row-major: the whole tensor): a view if uniform,
        else one gather."""
        part = self._nested_cols(nested, t)
        if t.uniform:
            return part
        mg, r = t.nest.on(nested, "mg", "r")
        return part[mg, r]

    def copy_out_nested(self, nested: torch.Tensor | list[NestedPart], t: TensorLayout, dst: torch.Tensor) -> None:
        """Tensor ``t`` from a NESTED buffer, or its column chunks (``NestedPart``), into ``dst``
        (at least m * c rows). Uneven: the columns are put together first (a view when one chunk
        holds them all), then its rows gathered."""
        m, g = self.info.m, self.info.g
        if isinstance(nested, torch.Tensor):
            nested = [(0, self.sum_g, nested.view(m, g, self.sum_g))]
        lo, hi = t.off_g, t.off_g + t.size_g
        mine = [(max(a, lo), min(b, hi), a, piece) for a, b, piece in nested if a < hi and lo < b]
        if t.uniform:
            cols = dst[: m * g * t.size_g].view(m, g, t.size_g)
        elif len(mine) == 1:
            x, y, a, piece = mine[0]
            cols, mine = piece[:, :, x - a : y - a], []
        else:
            cols = dst.new_empty(m, g, t.size_g)
        for x, y, a, piece in mine:
            cols[:, :, x - lo : y - lo].copy_(piece[:, :, x - a : y - a])
        if not t.uniform:  # one gather of the real rows, straight into dst
            mg, r = t.nest.on(cols, "mg", "r")
            torch.ops.aten.index.Tensor_out(cols.view(m * g, t.g_pad, t.row), [mg, r],
                                            out=dst[: t.d0 * t.row].view(t.d0, t.row))

    def copy_in_nested(self, nested: torch.Tensor, t: TensorLayout, src: torch.Tensor) -> None:
        """Write the whole tensor ``src`` into a NESTED buffer (its padding is left as it is)."""
        src = src.reshape(t.d0, t.row)
        if t.uniform:
            self._nested_cols(nested, t).copy_(src.view(self.info.m, self.info.g, t.size_g))
            return
        mg, r = t.nest.on(nested, "mg", "r")  # one scatter of the real rows
        self._nested_cols(nested, t).index_put_((mg, r), src.to(nested.dtype))

    def full_to_nested(self, full: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """FULL [m, sum_i] -> NESTED [m, g, sum_g] (``out`` zeroed by the caller where
        ``nested_uniform`` is false, if its padding matters)."""
        m, g = self.info.m, self.info.g
        for t in self.tensors:
            base = self.full_rows(full, t)
            if t.uniform:
                self._nested_cols(out, t).copy_(base.view(m, g, t.size_g))
                continue
            bl, bj, mg, r = t.nest.on(out, "bl", "bj", "mg", "r")  # one gather, one scatter
            self._nested_cols(out, t).index_put_((mg, r), base.view(m, t.c, t.row)[bl, bj].to(out.dtype))
        return out

    def nested_to_full(self, nested: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """NESTED [m, g, sum_g] -> FULL [m, sum_i] (padding rows of ``out`` are not written)."""
        m, g = self.info.m, self.info.g
        for t in self.tensors:
            base = self.full_rows(out, t)
            if t.uniform:
                base.view(m, g, t.size_g).copy_(self._nested_cols(nested, t))
                continue
            bl, bj, mg, r = t.nest.on(nested, "bl", "bj", "mg", "r")  # one gather, one scatter
            base.view(m, t.c, t.row).index_put_((bl, bj), self._nested_cols(nested, t)[mg, r].to(out.dtype))
        return out
