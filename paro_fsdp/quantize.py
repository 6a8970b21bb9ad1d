"""Quantized inter-group collectives: block-wise int8 / int4 codes on the wire, in pure torch.

Why: the link between groups is the scarce one. PaRO already crosses it once per step where it
can; a strategy that must cross it every micro-step (P = G gathers, G = G reductions) can send a
quarter of the bytes instead (ZeRO++'s qwZ and qgZ, here on PaRO's inter phases only: the fast
links inside a group keep the working dtype). Pure torch ops, so inductor can fuse them on a GPU.

The wire format: each piece (a rank's shard, or the part of a reduction bound for one rank) is cut
into ``QBLOCK``-element blocks, each scaled by its absmax (symmetric, round to nearest); the codes
and the fp32 scales travel as one uint8 buffer, one collective. A gather hands back every piece
dequantized, this rank's own too, so every replica of a tensor holds the same values. A reduction
cannot add codes on the wire: it is an all-to-all of quantized pieces, and each rank sums the pieces
it receives in fp32 (``collectives.QUANTIZED`` names the collectives; ``comm.MeshComm`` counts them).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .collectives import QBLOCK, WIRES

_wait = torch.ops._c10d_functional.wait_tensor  # what this module issues is plain functional collectives

__all__ = ["Deferred", "all_gather", "all_reduce", "pack", "reduce_scatter", "unpack"]


class Deferred:
    """A quantized collective's result: ``wait()`` waits for the codes and dequantizes them (once)."""

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result  # type: ignore[return-value]


def _blocks(numel: int) -> int:
    return -(-numel // QBLOCK)


def pack(rows: torch.Tensor, wire: str) -> torch.Tensor:
    """``rows`` ([r, s], any float dtype), each row quantized on its own -> [r, bytes] uint8: the
    codes (int4: two to a byte), then one fp32 scale per block."""
    bits = WIRES[wire]
    r, s = rows.shape
    nb = _blocks(s)
    x = rows.float()
    if nb * QBLOCK != s:
        x = F.pad(x, (0, nb * QBLOCK - s))
    x = x.view(r, nb, QBLOCK)
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=2, keepdim=True) / qmax
    q = torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-qmax, qmax)
    if bits == 8:
        codes = q.to(torch.int8).view(torch.uint8)
    else:  # offset to 1..15, two codes a byte
        u = (q + 8).to(torch.uint8)
        codes = u[..., 0::2] | (u[..., 1::2] << 4)
    return torch.cat([codes.reshape(r, -1), scale.view(r, nb).view(torch.uint8)], dim=1)


def unpack(buf: torch.Tensor, rows: int, numel: int, wire: str, dtype: torch.dtype) -> torch.Tensor:
    """``pack``'s bytes of ``rows`` pieces of ``numel`` elements -> [rows, numel] in ``dtype``."""
    bits = WIRES[wire]
    nb = _blocks(numel)
    b = buf.view(rows, -1)
    ncode = nb * QBLOCK * bits // 8
    scale = b[:, ncode:].contiguous().view(torch.float32).view(rows, nb, 1)
    codes = b[:, :ncode].reshape(rows, nb, -1)
    if bits == 8:
        q = codes.view(torch.int8).float()
    else:
        q = torch.stack([(codes & 15), (codes >> 4)], dim=-1).view(rows, nb, QBLOCK).float() - 8
    return (q * scale).view(rows, nb * QBLOCK)[:, :numel].to(dtype)


def all_gather(comm: Any, shard: torch.Tensor, dim: str, wire: str) -> Deferred:
    """Every rank's 1-D ``shard`` over ``dim``, concatenated in rank order, through ``wire``."""
    k, s = comm.info.size(dim), shard.numel()
    codes = comm.functional_all_gather(pack(shard.view(1, s), wire).view(-1), dim)
    return Deferred(lambda: unpack(_wait(codes), k, s, wire, shard.dtype).reshape(-1))


def _exchange(comm: Any, full: torch.Tensor, dim: str, wire: str) -> tuple[Any, int]:
    """The all-to-all of ``full``'s k pieces (padded to k equal ones), each quantized alone."""
    k = comm.info.size(dim)
    s = -(-full.numel() // k)
    x = full.reshape(-1)
    if k * s != x.numel():
        x = F.pad(x, (0, k * s - x.numel()))
    return comm.functional_all_to_all(pack(x.view(k, s), wire).view(-1), dim), s


def _summed(comm: Any, codes: Any, k: int, s: int, wire: str) -> torch.Tensor:
    """What the all-to-all brought (one piece from each rank), dequantized and summed in fp32."""
    return unpack(_wait(codes), k, s, wire, torch.float32).sum(dim=0)


def reduce_scatter(comm: Any, full: torch.Tensor, dim: str, wire: str) -> Deferred:
    """The sum over ``dim`` of the 1-D ``full`` (k equal pieces), this rank's piece, through ``wire``."""
    codes, s = _exchange(comm, full, dim, wire)
    k = comm.info.size(dim)
    return Deferred(lambda: _summed(comm, codes, k, s, wire).to(full.dtype))


def all_reduce(comm: Any, t: torch.Tensor, dim: str, wire: str) -> Deferred:
    """The sum over ``dim`` of ``t``: the quantized reduce-scatter, then its piece quantized again
    and gathered (every rank ends with the same values)."""
    codes, s = _exchange(comm, t, dim, wire)
    k = comm.info.size(dim)

    def finish() -> torch.Tensor:
        piece = _summed(comm, codes, k, s, wire)
        whole = comm.functional_all_gather(pack(piece.view(1, s), wire).view(-1), dim)
        return unpack(_wait(whole), k, s, wire, t.dtype).reshape(-1)[: t.numel()].view(t.shape)

    return Deferred(finish)
