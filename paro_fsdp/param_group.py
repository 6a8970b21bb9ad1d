"""One bucket of parameters that share a strategy inside one block: its storage and its micro-step moves
(its buffers: docs/ARCHITECTURE.md). Trainable tensors come first in P, so its prefixes line up with the
trainable-only G and OS buffers and master -> P is one flat copy when levels agree. Every global collective
is one PaRO-CC call (``cc``) on NESTED buffers (layout.py), so no rank order is fixed up afterwards.
"""
from __future__ import annotations

import enum
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .collectives import Dim
from .comm import MeshComm, Work
from .paro_cc import ParoCC
from .layout import FlatLayout, TensorLayout, param_placements, tensor_layout
from .mesh import MeshInfo, mesh_device
from .mixed_precision import MixedPrecision
from .param import ParamRef, ParoParam
from .plan import plan_of
from .strategy import Level, Strategy
from .streams import active


class GradAccumulator:
    """A group's G-level gradient, summed over micro-steps in the accumulate dtype: one owner for the eager
    backward, the traced path's sink and the boundary; allocated at the first backward, freed at the boundary."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.tensor: torch.Tensor | None = None

    def ensure(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            torch._dynamo.mark_static(self.tensor)  # an input of the last micro-step's graph (see p_flat)
        return self.tensor

    def add(self, grad: torch.Tensor) -> None:
        """Sum ``grad`` in; the first one, before any ``ensure``, is taken as is (cast)."""
        if self.tensor is None:
            self.tensor = grad.to(self.dtype)
            torch._dynamo.mark_static(self.tensor)  # an input of the last micro-step's graph (see p_flat)
        else:
            self.tensor.add_(grad)

    def sum(self) -> torch.Tensor:
        """The sum so far: zeros if no backward reached the group."""
        return self.tensor if self.tensor is not None else torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def zero(self) -> None:
        if self.tensor is not None:
            self.tensor.zero_()

    def free(self) -> None:
        """Between steps the gradients live in the parameters' ``.grad`` only, as FSDP2's."""
        self.tensor = None


class GradState(enum.Enum):
    """A group's gradients between optimizer steps."""
    EMPTY = 0  # nothing since the last reduction to the OS level (the parameters' .grad hold it)
    AT_G = 1  # summed at the G level over unsynced micro-steps, not yet reduced to the OS level


class ShardState(enum.Enum):
    SHARDED = 0
    GATHERING = 1  # first collective issued (prefetch), not yet copied out
    UNSHARDED = 2


class ParoParamGroup:
    def __init__(self, name: str, strategy: Strategy, refs: list[ParamRef], info: MeshInfo, comm: MeshComm, cc: ParoCC,
                 mp: MixedPrecision, reshard_after_forward: bool,
                 param_init_fn: Callable[[str, torch.Tensor], None] | None = None) -> None:
        self.name, self.strategy, self.info, self.mp = name, strategy, info, mp
        self.plan = plan_of(strategy, mp.inter_dtype)  # its collectives, phase by phase (plan.py)
        self.comm, self.cc = comm, cc  # one-dimension collectives; global ones (PaRO-CC), both the model's
        self.refs = sorted(refs, key=lambda r: not r.requires_grad)  # trainable first
        self.trainable = [r for r in self.refs if r.requires_grad]
        self.reshard_after_forward = reshard_after_forward and not self.plan.params_whole
        # every buffer on the mesh's device: a CPU-built model moves shard by shard (NCCL never sees CPU tensors)
        self.device = device = mesh_device(info)
        layouts = [tensor_layout(r.fqn, r.shape, info) for r in self.refs]
        self.p_layout = FlatLayout(layouts, info)
        self.t_layout = FlatLayout(layouts[: len(self.trainable)], info)
        if self.t_layout.tensors:  # the trainable prefix must line up in both layouts
            assert self.t_layout.tensors[-1].off_i + self.t_layout.tensors[-1].size_i <= self.p_layout.sum_i

        originals = [r.source.detach() for r in self.refs]
        if param_init_fn is not None:  # materialise meta tensors whole, one group at a time
            for i, (r, o) in enumerate(zip(self.refs, originals)):
                if o.is_meta:
                    originals[i] = torch.empty(o.shape, dtype=torch.float32, device=device)
                    param_init_fn(r.fqn, originals[i])
        P, OS = strategy.p, strategy.os
        n_t = len(self.trainable)
        # P = OS: the fp32 masters are the P storage, shared in fp32, else sent cast by each gather (FSDP2's
        # copy-in) with no param-dtype copy beside them (bf16 GGG holds FSDP2's 16 bytes a parameter, not 18)
        plan = self.plan
        self.shares_p = plan.p_at_os and mp.param_dtype == torch.float32
        self.casts_p = plan.p_shard_at_os and mp.param_dtype != torch.float32 and n_t == len(self.refs)
        with torch.no_grad():
            if plan.params_whole:
                flat = None
                working = [o.to(device=device, dtype=mp.param_dtype, copy=True) for o in originals]
            else:
                flat = self.p_layout.new(P, torch.float32 if self.casts_p else mp.param_dtype, device)
                # its size differs per group: left dynamic, the next block's graph would recompile symbolic
                torch._dynamo.mark_static(flat)
                working = [self.p_layout.local_view(flat, t, P) for t in layouts]
                for local, t, o in zip(working, layouts, originals):
                    local.copy_(t.local_slice(o, P, info.k))
            self.p_flat = None if self.casts_p else flat
            self.params = [ParoParam(r, t, w) for r, t, w in zip(self.refs, layouts, working)]
            if self.shares_p or self.casts_p:  # trainable tensors come first in P: the masters are its prefix
                self.master_flat = flat if n_t == len(self.refs) else None
                masters = working[:n_t]
            elif plan.masters_whole:
                self.master_flat = None
                masters = [o.to(device=device, dtype=torch.float32, copy=True) for o in originals[:n_t]]
            else:
                self.master_flat = self.t_layout.new(OS, torch.float32, device)
                masters = [self.t_layout.local_view(self.master_flat, t, OS) for t in self.t_layout.tensors]
                for local, t, o in zip(masters, self.t_layout.tensors, originals):
                    local.copy_(t.local_slice(o, OS, info.k))
            for p, m in zip(self.params, masters):
                p.master = m

        # the module's parameters: the fp32 masters at OS (FSDP2's sharded ones); a frozen one its only copy, at P
        for p in self.params:
            local, level = (p.master, OS) if p.trainable else (p.working, P)
            dt = DTensor.from_local(local, info.param_mesh or info.mesh, param_placements(level, info), run_check=False,
                                    shape=p.layout.shape, stride=p.ref.stride)
            p.param = nn.Parameter(dt, requires_grad=p.trainable)
            p.register()
            p.ref.source = None
        del originals
        self.pushed_version = self.params_version()

        # whole tensors while unsharded: the working copies (P = N) or views of padded buffers
        for p in self.params:
            if plan.params_whole:
                p.whole = p.working
            else:
                p.whole_buf = torch.empty(info.m * p.layout.size_i, dtype=mp.param_dtype, device=device)
                p.whole = p.whole_buf[: p.ref.numel].view(p.ref.shape)
                p.whole_buf.untyped_storage().resize_(0)
        self.state = ShardState.UNSHARDED if plan.params_whole else ShardState.SHARDED
        self._pending: Work | None = None
        self.grad_acc = GradAccumulator(self.t_layout.numel(strategy.g), mp.acc_dtype, device)
        self._pending_rs: Work | None = None
        self._gather_buf = self._rs_buf = None  # pooled buffers in flight (comm.BufferPool)
        self.grads = GradState.EMPTY
        self.uses_left = 0  # forward uses whose backward has not run (a module called twice): the boundary waits
        # a backward reduces to the OS level when both are set (FSDP2's requires_gradient_sync, is_last_backward)
        self.requires_sync = self.is_last = True
        self.requires_all_reduce = True  # FSDP2's HSDP switch: False defers the reduction like requires_sync
        self.reshard_after_backward = True
        self.sink: torch.Tensor | None = None  # gradient leaves of the traced path (traced.py)
        self.os_sink: torch.Tensor | None = None
        self.grad_divide_factor: float | None = None  # None: the world size (set_gradient_divide_factor)
        # per trainable tensor, since the last boundary: no micro-step's backward gave it a gradient here
        # (None: nothing tracked, the traced path); at the boundary, whether it did (used_here), which the
        # end of backward asks the other ranks (ParoState.used_grads) for the tensors still undecided:
        # (index, parameter, .grad made by this boundary)
        self.unused: list[bool] | None = None
        self.used_here: list[bool] | None = None
        self.undecided: list[tuple[int, torch.Tensor, bool]] = []

    @property
    def divide(self) -> float:
        """What the summed gradient is divided by: the world size, or ``set_gradient_divide_factor``'s."""
        return float(self.info.n if self.grad_divide_factor is None else self.grad_divide_factor)

    @property
    def predivide(self) -> float:
        """The part of ``divide`` applied before the first reduction (fp16 only; the rest at the step)."""
        return self.mp.predivide(self.divide)

    @property
    def last_backward(self) -> bool:
        """Whether the next backward reduces the gradients to the OS level (the step boundary)."""
        return self.requires_sync and self.is_last and self.requires_all_reduce

    def params_version(self) -> int:
        """Grows with every in-place write of a trainable parameter (an optimizer step, a load)."""
        return sum(p.version() for p in self.params if p.trainable)

    # ---- the tensors' parts, in bucket order (trainable first): views over ``params`` ----------
    @property
    def sharded_params(self) -> list[nn.Parameter]:
        return [p.param for p in self.params]

    @property
    def master(self) -> list[torch.Tensor]:
        """The trainable tensors' OS-level fp32 shards (their parameters' local tensors)."""
        return [p.master for p in self.params if p.trainable]

    @property
    def p_locals(self) -> list[torch.Tensor]:
        return [p.working for p in self.params]

    @property
    def full_bufs(self) -> list[torch.Tensor] | None:
        """The whole tensors' padded buffers (None for P = N: the working copies are whole)."""
        return None if self.plan.params_whole else [p.whole_buf for p in self.params]

    @property
    def full_params(self) -> list[torch.Tensor]:  # valid while gathered
        return [p.whole for p in self.params]

    # ---- the micro-step's moves, one implementation for the eager hooks and traced.py ---------
    # Buffer order and padding are decided here once: FULL for the intra level, NESTED for the global one.
    def gather_params(self, parts: bool = False) -> Work:
        """Issue the all-gather of the P-level shard: FULL (P = I) or NESTED (P = G, PaRO-CC; ``parts``: its
        chunks as they arrived, for ``copy_out``)."""
        (move,) = self.plan.gather
        if move.dim == Dim.GLOBAL:
            return self.cc.all_gather(self.p_send(), order="nested", params=True, parts=parts, wire=move.wire)
        out = self._take(self.info.m * self.p_layout.sum_i, self.mp.param_dtype) if parts else None
        if out is not None:  # (never set while tracing: torch 2.11's dynamo refuses the mutation in a HOP)
            self._gather_buf = out  # handed back to the pool after the copy-out (``unshard``)
        return self.comm.all_gather(self.p_send(), move.dim, params=True, out=out)

    def p_send(self) -> torch.Tensor:
        """The P storage, or (``casts_p``) the fp32 masters cast on the gather's stream: after the masters'
        writes (``streams.params_written``) but not the compute queued since."""
        if not self.casts_p:
            return self.p_flat
        streams = active(self.comm.streams)
        if streams is None:
            return self.master_flat.to(self.mp.param_dtype)
        with streams.issue("params"):
            return self.master_flat.to(self.mp.param_dtype)

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A pooled buffer (comm.BufferPool); None where collectives allocate their own (a GPU, tracing)."""
        pool = self.comm.pool
        return None if pool is None or torch.compiler.is_compiling() else pool.take(numel, dtype, self.device)

    def _give(self, buf: torch.Tensor | None) -> None:
        if buf is not None:
            self.comm.pool.give(buf)

    def whole_rows(self, gathered: torch.Tensor, t: TensorLayout) -> torch.Tensor:
        """Tensor ``t``'s rows in ``gather_params``' result: row-major, its first numel elements are it."""
        layout = self.p_layout
        return layout.nested_rows(gathered, t) if self.plan.runs_global("gather") else layout.full_rows(gathered, t)

    def copy_out(self, gathered: torch.Tensor | list, t: TensorLayout, dst: torch.Tensor) -> None:
        """Tensor ``t`` from ``gather_params(parts=True)``'s result into its padded whole buffer, in one copy."""
        if self.plan.runs_global("gather"):
            self.p_layout.copy_out_nested(gathered, t, dst)
        else:
            rows = self.p_layout.full_rows(gathered, t)
            dst[: rows.numel()].view_as(rows).copy_(rows)

    def grad_buffer(self, grads: list[torch.Tensor | None], into: torch.Tensor | None = None) -> torch.Tensor:
        """The whole-tensor gradients (None: zeros) laid out NESTED (G = G) or FULL, in the reduce dtype,
        padding zero; ``into`` (G = N, eager): added into that FULL accumulator instead."""
        layout, dt, pre = self.t_layout, self.mp.grad_dtype, self.predivide
        if pre != 1.0:  # fp16: each rank's part divided before any sum (MixedPrecision.predivide)
            grads = [g_ if g_ is None else g_.to(dt) / pre for g_ in grads]
        if into is not None:
            for t, grad in zip(layout.tensors, grads):
                if grad is not None:
                    layout.copy_in(into, t, grad.to(into.dtype), add=True)
            return into
        present = all(g_ is not None for g_ in grads)
        if self.plan.runs_global("reduce"):
            dense = present and layout.nested_uniform
            buf = self._new(layout.numel_nested(), dt, dense)
            for t, grad in zip(layout.tensors, grads):
                if grad is not None:
                    layout.copy_in_nested(buf, t, grad.to(dt))
            return buf
        dense = present and all(t.d0 == self.info.m * t.c for t in layout.tensors)
        full = self._new(layout.numel(Level.N), dt, dense)
        if dense:  # one op: each whole gradient as [m, size_i] columns of FULL
            m = self.info.m
            torch.cat([g_.to(dt).reshape(m, t.size_i) for t, g_ in zip(layout.tensors, grads)], dim=1,
                      out=full.view(m, layout.sum_i))
            return full
        for t, grad in zip(layout.tensors, grads):
            if grad is not None:
                layout.copy_in(full, t, grad.to(dt))
        return full

    def _new(self, numel: int, dtype: torch.dtype, dense: bool) -> torch.Tensor:
        """The reduction's input: pooled where eager (``_rs_buf``), zeroed unless every element is written."""
        buf = self._take(numel, dtype)
        if buf is None:  # a GPU or the traced path: nothing pooled, the group left as it is
            return (torch.empty if dense else torch.zeros)(numel, dtype=dtype, device=self.device)
        self._rs_buf = buf
        return buf if dense else buf.zero_()

    def reduce_grad_buffer(self, buf: torch.Tensor) -> Work | None:
        """Issue the reduction of ``grad_buffer``'s result to this rank's G-level shard (none for G = N)."""
        if not self.plan.reduce:
            return None
        (move,) = self.plan.reduce
        if move.dim == Dim.GLOBAL:
            return self.cc.reduce_scatter(buf, order="nested", wire=move.wire)
        return self.comm.reduce_scatter(buf, move.dim, wire=move.wire)

    # ---- parameters: shard <-> whole (eager) ---------------------------------------------
    def register(self, tensors: list[torch.Tensor]) -> None:
        """Every module attribute holding the group's parameters set to ``tensors``: the whole tensors while
        unsharded (as FSDP2's, so a call into an inner module works), else the sharded parameters."""
        for ref, t in zip(self.refs, tensors):
            for owner, attr in ref.owners:
                owner._parameters[attr] = t

    def register_sharded(self) -> None:
        self.register(self.sharded_params)

    def issue_unshard(self) -> None:
        """Start the all-gather (a prefetch); it is in flight until ``unshard`` waits."""
        if self.state != ShardState.SHARDED:
            return
        self._pending = self.gather_params(parts=True)
        self.state = ShardState.GATHERING

    def unshard(self) -> None:
        if self.state == ShardState.UNSHARDED:
            return
        self.issue_unshard()
        gathered = self._pending.wait()  # FULL (P=I) or NESTED chunks (P=G)
        self._pending = None
        bufs = tuple(p.whole_buf for p in self.params)
        for b in bufs:
            b.untyped_storage().resize_(b.numel() * b.element_size())
        with torch.autograd._unsafe_preserve_version_counter(bufs):
            if self.plan.runs_global("gather"):
                for p in self.params:
                    self.copy_out(gathered, p.layout, p.whole_buf)
            else:  # one op: each tensor's [m, size_i] columns into its buffer (FSDP2's)
                m, sizes = self.info.m, [t.size_i for t in self.p_layout.tensors]
                torch.split_with_sizes_copy(gathered.view(m, -1), sizes, dim=1,
                                            out=[b.view(m, n) for b, n in zip(bufs, sizes)])
        streams = active(self.comm.streams)
        if streams is not None:  # the result's memory is reused only after these copies (streams.py)
            streams.copied_out(gathered)
        self._give(self._gather_buf)
        self._gather_buf = None
        self.state = ShardState.UNSHARDED

    def reshard(self) -> None:
        """Free the whole tensors; the modules hold the sharded parameters again (never a freed buffer)."""
        self.register_sharded()
        if self.plan.params_whole or self.state == ShardState.SHARDED:
            return
        if self.state == ShardState.GATHERING:
            self._pending.wait()
            self._pending = None
            self._give(self._gather_buf)
            self._gather_buf = None
        else:
            for p in self.params:
                p.whole_buf.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    # ---- gradients: each micro-step (eager) ------------------------------------------------
    def reduce_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Start this micro-step's gradients to the G level, in flight under the next block's backward until
        ``finish_grad_reduction``."""
        acc = self.grad_acc.ensure()
        self.grads = GradState.AT_G
        none = [g_ is None for g_ in grads]
        self.unused = none if self.unused is None else [a and b for a, b in zip(self.unused, none)]
        self.finish_grad_reduction()  # the group used again in this backward: one reduction in flight per group
        if self.plan.grads_whole:  # nothing on the wire: add straight into the accumulator
            self.grad_buffer(grads, into=acc)
            return
        self._pending_rs = self.reduce_grad_buffer(self.grad_buffer(grads))

    def advance_grad_reduction(self) -> None:
        """Put the in-flight reduction's next phase on the wire (PaRO-CC: the inter phase)."""
        if self._pending_rs is not None:
            self._pending_rs.advance()

    def finish_grad_reduction(self) -> None:
        if self._pending_rs is None:
            return
        shard = self._pending_rs.wait()  # G=G: issues the inter phase and waits for it
        self._pending_rs = None
        if self._rs_buf is not None and shard.untyped_storage().data_ptr() != self._rs_buf.untyped_storage().data_ptr():
            self._give(self._rs_buf)  # its input, reduced (unless the result is the input: a size-1 dim)
        self._rs_buf = None
        self.grad_acc.add(shard)  # reduce dtype on the wire, summed in the accumulate dtype

    def zero_grad(self) -> None:
        """Drop the gradients not yet reduced to the OS level (``.grad`` is the user's optimizer's to clear)."""
        self.grad_acc.zero()
        self.grads = GradState.EMPTY
        self.unused = None

    # ---- accounting ------------------------------------------------------------------------
    def memory_bytes(self, optimizer_states: dict | None = None) -> dict[str, int]:
        """Bytes this rank holds for P, G, OS (padding included), the fp32 master gradients (boundary to
        ``zero_grad``) and the boundary's full-size temporaries (reducing G = N, pushing to P = N)."""
        p_tensors = [] if self.casts_p else [self.p_flat] if self.p_flat is not None else self.p_locals
        p_bytes = sum(t.numel() * t.element_size() for t in p_tensors)  # casts_p: the masters, counted in OS
        plan, layout = self.plan, self.t_layout
        g_numel = layout.numel(self.strategy.g) if self.trainable else 0
        g_bytes = g_numel * self.mp.acc_dtype.itemsize
        os_numel = self.master_flat.numel() if self.master_flat is not None else sum(m_.numel() for m_ in self.master)
        os_bytes = 0 if self.shares_p else os_numel * 4  # shared: counted in P
        for param in self.sharded_params[: len(self.trainable)]:
            for v in (optimizer_states or {}).get(param, {}).values():
                if isinstance(v, DTensor):
                    v = v.to_local()
                if torch.is_tensor(v) and v.dim() > 0:
                    os_bytes += v.numel() * v.element_size()
        boundary_grads = boundary_params = 0
        if self.trainable and self.info.n > 1:
            full = layout.numel(Level.N)
            gb = self.mp.grad_dtype.itemsize
            cast = gb if self.mp.acc_dtype != self.mp.grad_dtype else 0
            if plan.grads_whole:  # the accumulator cast to the wire dtype, then (global) a FULL-size collective buffer
                boundary_grads = full * cast + (full * gb if plan.runs_global("boundary") else 0)
            if plan.params_whole and plan.push:  # gathered to FULL (global: NESTED, then FULL)
                boundary_params = full * self.mp.param_dtype.itemsize * (2 if plan.runs_global("push") else 1)
        return {"P": p_bytes, "G": g_bytes, "OS": os_bytes, "master_grads": os_numel * 4 if self.trainable else 0,
                "boundary_grads": boundary_grads, "boundary_params": boundary_params}
