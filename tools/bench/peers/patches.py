"""Every stand-in or patch a peer needs to run here (CPU, gloo, no CUDA), in one place, each beside
its reason. Each is switchable: ``--no-patch NAME[,NAME]`` on ``python -m tools.bench.peers run``
or the worker (the bench: ``PARO_PEERS_NO_PATCH=NAME,...``), to see what the release does without
it. A patch marked approximate changes the arithmetic (losses close to one process's, not equal);
rows that run through one say so.

The patches change the peer's code in the worker's process only (attributes of its classes and
modules, set at run time), never its installed files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from . import Peer


@dataclass(frozen=True)
class Patch:
    name: str
    peers: tuple[str, ...]  # the --baselines values it applies to
    reason: str  # why the release needs it here
    what: str  # what it does
    apply: Callable[[], None]
    approximate: bool = False


# ---- DeepSpeed -------------------------------------------------------------------------------------
def _mics_all_gather_coalesced() -> None:
    """``TorchBackend.all_gather_coalesced`` as one async all-gather per tensor, returning a handle
    that waits on all of them."""
    import torch.distributed as dist
    from deepspeed.comm.torch import TorchBackend

    class _Handles:
        def __init__(self, reqs: list) -> None:
            self.reqs = reqs

        def wait(self) -> None:
            for r in self.reqs:
                r.wait()

        def is_completed(self) -> bool:
            return all(r.is_completed() for r in self.reqs)

    def all_gather_coalesced(self, output_tensors, input_tensors, group=None, async_op=False):
        reqs = [dist.all_gather_into_tensor(o, i, group=group, async_op=True)
                for o, i in zip(output_tensors, input_tensors)]
        h = _Handles(reqs)
        if async_op:
            return h
        h.wait()

    TorchBackend.all_gather_coalesced = all_gather_coalesced


def _zeropp_quantizer() -> None:
    """A pure-torch stand-in of DeepSpeed's CUDA quantizer op module (``QuantizerBuilder().load()``):
    symmetric per-group quantization (scale = absmax / (2^(bits-1) - 1), round, clamp) for qwZ's
    int8 weight all-gather, and qgZ's int4 ``swizzle_quant`` / ``quantized_reduction`` with the
    swizzle as the identity layout (the data each rank sends, in order) and values kept in int8."""
    import torch
    from deepspeed.ops import op_builder

    class Symmetric:  # the op module's enum value
        pass

    def _groups(x: torch.Tensor, groups: int) -> torch.Tensor:
        return x.reshape(groups, -1).float()

    def quantize(x, groups, bits, _kind):
        g = _groups(x, groups)
        q_max = 2 ** (bits - 1) - 1
        scale = (g.abs().amax(dim=1, keepdim=True) / q_max).clamp_min(1e-12)
        q = torch.round(g / scale).clamp_(-q_max - 1, q_max).to(torch.int8)
        return q.reshape(x.shape), scale.reshape(-1)

    def dequantize(q, scale, groups, bits, _kind):
        # q may be narrowed to a parameter's numel while the scales cover its padded partitions
        # (padding < world size <= groups): group size = ceil(numel / groups), pad, cut, q's shape back
        flat = q.reshape(-1).float()
        size = -(-flat.numel() // groups)
        padded = torch.nn.functional.pad(flat, (0, size * groups - flat.numel()))
        out = (padded.reshape(groups, size) * scale.reshape(-1, 1).float()).reshape(-1)[:flat.numel()]
        return out.reshape(q.shape).to(torch.half)

    def swizzle_quant(x, groups, bits, kind, _pipeline, _nodes, _devices):
        return quantize(x.reshape(-1), groups, bits, kind)

    def quantized_reduction(q, scale, in_groups, out_groups, bits, kind, devices_per_node):
        # q: devices_per_node quantized pieces of the same slice, one from each rank: dequantize, sum, requantize
        vals = (_groups(q, in_groups) * scale.reshape(-1, 1).float()).reshape(devices_per_node, -1).sum(0)
        return quantize(vals, out_groups, bits, kind)

    module = type("QuantizerStandIn", (), {
        "Symmetric": Symmetric, "quantize": staticmethod(quantize),
        "dequantize": staticmethod(lambda q, s, g, b, k: dequantize(q, s, g, b, k)),
        "swizzle_quant": staticmethod(swizzle_quant), "quantized_reduction": staticmethod(quantized_reduction)})()

    op_builder.QuantizerBuilder.load = lambda self, verbose=True: module


# ---- Megatron-FSDP ---------------------------------------------------------------------------------
def _mfsdp_cuda_noops() -> None:
    """The torch.cuda functions Megatron-FSDP calls, as CPU stand-ins: streams and events whose
    waits do nothing (CPU ops and gloo's waited-on work run in order on the calling thread),
    ``stream(s)`` a null context, ``synchronize`` / ``empty_cache`` no-ops, ``current_device`` 0
    (only compared with the device it is given: cpu), ``Tensor.cuda()`` the tensor itself."""
    import contextlib

    import torch

    class _Stream:
        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def wait_stream(self, *a: Any) -> None:
            pass

        def wait_event(self, *a: Any) -> None:
            pass

        def record_event(self, *a: Any) -> "_Stream":
            return self

        def synchronize(self) -> None:
            pass

        def wait(self, *a: Any) -> None:
            pass

        def record(self, *a: Any) -> None:
            pass

        def query(self) -> bool:
            return True

    cuda = torch.cuda
    cuda.Stream = _Stream
    cuda.Event = _Stream
    _current = _Stream()
    cuda.current_stream = lambda *a, **k: _current
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.current_device = lambda: 0
    torch.Tensor.cuda = lambda self, *a, **k: self  # validate_uneven_dtensor moves its check tensor to cuda


def _mfsdp_adam_step() -> None:
    """``megatron_fsdp.fully_shard_optimizer`` wrapped: its pre-init ``optimizer.step()`` (zero
    gradients, to create the states) is undone: the parameters' values restored, the states'
    step counts and moments back to zero."""
    import megatron_fsdp
    import torch

    orig = megatron_fsdp.fully_shard_optimizer

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def fully_shard_optimizer(optimizer, *a, **k):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = [local(p).detach().clone() for p in params]
        out = orig(optimizer, *a, **k)
        with torch.no_grad():
            for p, v in zip(params, saved):
                local(p).copy_(v)
            for st in optimizer.state.values():
                for key, v in st.items():
                    if torch.is_tensor(v):
                        local(v).zero_()
                    elif key == "step":
                        st[key] = 0
        return out

    megatron_fsdp.fully_shard_optimizer = fully_shard_optimizer


def _mfsdp_hfsdp_grad_scale() -> None:
    """``param_and_grad_buffer._create_hfsdp_helper_buffer`` wrapped: the helper buffer gets the
    ``gradient_scaling_factor`` of the buffer it helps (the release builds it without one, so its
    reduce-scatter sums the gradients where the main buffer's averages them)."""
    from megatron_fsdp import param_and_grad_buffer as pgb

    orig = pgb._create_hfsdp_helper_buffer

    def _create_hfsdp_helper_buffer(dp_buffer, *a, **k):
        helper = orig(dp_buffer, *a, **k)
        if helper.gradient_scaling_factor is None:
            helper.gradient_scaling_factor = dp_buffer.gradient_scaling_factor
        return helper

    pgb._create_hfsdp_helper_buffer = _create_hfsdp_helper_buffer


_MFSDP = ("mfsdp-zero3", "mfsdp-hsdp", "mfsdp-hfsdp")
PATCHES = {p.name: p for p in (
    Patch("mics-coalesced-gather", ("ds-mics",),
          "gloo has no coalescing manager: MiCS's flat all-gather of a module's parameters goes through "
          "dist.all_gather_coalesced under torch's _coalescing_manager, which gloo does not implement",
          "TorchBackend.all_gather_coalesced issues one async all-gather per tensor and returns a handle waiting on "
          "each (the same collectives, not fused into one)", _mics_all_gather_coalesced),
    Patch("zeropp-quantizer", ("ds-zeropp",),
          "ZeRO++ qwZ / qgZ quantize through DeepSpeed's CUDA quantizer op (QuantizerBuilder), which needs CUDA",
          "a pure-torch stand-in: symmetric per-group int8 (qwZ) / int4 (qgZ) quantize, dequantize, reduce; the "
          "swizzle is the identity layout. Approximate by design: the losses are close to one process's, not equal",
          _zeropp_quantizer, approximate=True),
    Patch("mfsdp-cuda-noops", _MFSDP,
          "Megatron-FSDP calls torch.cuda stream, event and device functions unconditionally (current_stream, "
          "Stream, synchronize, current_device ...), which fail on a CPU-only torch",
          "those torch.cuda calls become no-ops / CPU stand-ins in the worker's process", _mfsdp_cuda_noops),
    Patch("mfsdp-adam-step", _MFSDP,
          "Megatron-FSDP's optimizer pre-init (fully_shard_optimizer) steps the optimizer once with zero gradients "
          "to create its states: AdamW's step count advances by one (its bias corrections then differ from one "
          "process's) and weight decay scales the weights by 1 - lr x wd before training starts",
          "that step undone: the weights restored, step counts and moments back to 0", _mfsdp_adam_step),
    Patch("mfsdp-hfsdp-grad-scale", ("mfsdp-hfsdp",),
          "HFSDP's helper gradient buffer (outer 'optim' sharding), which HFSDP reduce-scatters instead of the main "
          "one, is built without the gradient scaling factor (_create_hfsdp_helper_buffer): the gradients come out "
          "x world size (visible with SGD and no clipping, hidden by Adam)",
          "the helper buffer gets the main gradient buffer's scaling factor (1 / data-parallel size)",
          _mfsdp_hfsdp_grad_scale),
)}

#: settings of a peer's own config that are not patches (no code of the peer is changed), beside their reason
CONFIG_NOTES = {
    "mfsdp": "ddp_config.gradient_reduce_div_fusion = False: gloo has no PREMUL_SUM reduce op, so the division "
             "by the data-parallel size runs as its own step (Megatron-FSDP's option)",
    "deepspeed": "the CPU accelerator falls back to gloo without oneCCL; ops not prebuilt (DS_BUILD_OPS=0)",
}


def active(peer: Peer, off: set[str]) -> set[str]:
    """The patches that apply to ``peer``, less those switched off (``off`` and
    ``$PARO_PEERS_NO_PATCH``)."""
    off = off | set(filter(None, os.environ.get("PARO_PEERS_NO_PATCH", "").split(",")))
    unknown = off - set(PATCHES)
    if unknown:
        raise SystemExit(f"unknown patch(es) {','.join(sorted(unknown))}; valid: {','.join(PATCHES)}")
    return {n for n, p in PATCHES.items() if peer.name in p.peers and n not in off}


def apply(peer: Peer, names: set[str]) -> list[str]:
    """Apply ``names`` (from ``active``) in the table's order; returns them."""
    done = []
    for n, p in PATCHES.items():
        if n in names:
            p.apply()
            done.append(n)
    return done


def describe() -> list[dict[str, Any]]:
    return [{"name": p.name, "peers": list(p.peers), "reason": p.reason, "what": p.what,
             "approximate": p.approximate} for p in PATCHES.values()]
