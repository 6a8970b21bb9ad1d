"""Stand-in kernels for the functional collectives: real multi-rank results over gloo, delivered
only where and when the collective's ``wait_tensor`` says they are ready.

Why: NCCL refuses two ranks on one GPU, so on the one lent GPU nothing would move real data
between ranks, and a missing stream wait or a buffer freed early would change no number. These
kernels replace torch's for the ``_c10d_functional`` ops the engine, DTensor and compiled graphs
issue (``OPS``; registered with ``torch.library`` for one device's dispatch key by
``StandIn.install``, only by the stream tests (tests/test_gpu_streams.py), never by the engine).
Every result is the exact collective, computed by the synchronous gloo collective on host copies
of the ranks' inputs, but:

**Deferred completion (CPU and CUDA).** The op returns its output filled with poison (NaN; the
dtype's minimum for integers; True for bool) and registers a ``dist.Work`` for it
(``torch._C._distributed_c10d._register_work``, as torch's own kernels do), whose ``wait()`` --
called by ``_c10d_functional.wait_tensor``, eagerly and inside compiled graphs alike -- runs the
gloo collective and only then writes the result into the output. A consumer that reads before
waiting reads poison, which reaches the loss and the parameters. On CPU the collective reads its
input when ``wait()`` runs (NCCL may read it at any time until then, so an input changed after
the issue is caught too); an in-place op (``all_reduce_``) snapshots its input at the issue.
All ranks wait in the same order (the engine requires it of every collective), so the
synchronous collectives at ``wait()`` pair up across ranks; a result nobody waits for is never
computed, on any rank.

**Stream order (CUDA), as NCCL does it.** NCCL runs a collective on an internal stream per
process group that first waits for the stream current at the issue, and ``wait()`` makes the
stream current at the *wait* wait for the collective's end event (``WorkNCCL::synchronizeStream``):
stream-side, the host never blocks. The stand-in keeps that contract with two internal streams
per process group:

* at the issue (current stream S: the engine's side stream, ``streams.CommStreams.issue``, which
  first made S wait for the compute stream -- or, for a micro-step's parameter gather, for the
  copy-outs of the results it may reuse and the last write of P; or the compute stream inside a
  compiled graph):
  the *input* stream waits for S, then poisons the output and copies the input to pinned host
  memory (non_blocking). The input is read in stream order after S, so a side stream that did not
  wait for the compute stream reads a stale input -- the tests' model stalls the compute stream
  (``stream_workload.delay``) so that it lags the host.
* at ``wait()`` (current stream W; in the engine's eager path ``comm.on_side_stream`` calls
  ``wait_tensor`` inside the side-stream context, so W = S): the host waits for the input copy
  only (polling its event, which NCCL does not need; see below), runs the gloo collective, and the
  *result* stream -- after the poison -- sleeps (``torch.cuda._sleep``, ``result_delay_cycles``)
  and then copies the result into the output from pinned memory (non_blocking); W waits for
  that, stream-side. The engine's consumer (the compute stream) waits for an event recorded on
  S after ``wait_tensor`` (``Pending.wait``): a consumer that skips it reads the poison during
  the sleep. Two chained phases on different process groups (PaRO-CC's intra then inter) run on
  different streams, as on NCCL, so a missing wait between them is not hidden by one stream's
  order; inside a compiled graph a consumer moved above its ``wait_tensor`` reads poison too.
* lifetimes: the ``Work`` holds the output and the host copies until ``wait()``; the output is
  allocated on S (as NCCL's), its writes on the internal streams are ordered before S by the
  wait, so a block the caching allocator hands out again after the consumer frees it is never
  written by the stand-in.

What it cannot show: NCCL itself (its kernels, its watchdog, real bandwidth and overlap); a buffer
freed early *before* its ``wait()`` (the input is already on the host by the time ``wait()``
returns on S, while NCCL may still be reading it); and the host-side wait it adds (polling the
input copy's event at ``wait()``; invisible to the sanitizer and the sync debug mode, which must
judge the engine as if NCCL ran) makes the host catch up with S at every wait, which shortens,
but does not remove, the compute stream's lag (the model's stalls sit between the waits and the
next issue).
"""
from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

#: the ``_c10d_functional`` ops replaced: what the engine issues (comm.py, paro_cc.py), what
#: inductor lowers them to (the _out / in-place forms, torch's bucketing's _out gathers) and
#: what DTensor issues
OPS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
       "reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
       "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
       "broadcast", "broadcast_", "all_to_all_single")
DEVICES = ("cpu", "cuda")
_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "product": dist.ReduceOp.PRODUCT}


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What an unfinished output holds: NaN for floating and complex dtypes, True for bool, the
    most negative value for integers (an index no tensor has)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


def _group(group_name: Any) -> dist.ProcessGroup:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# ---- the collectives on host tensors (synchronous gloo) -------------------------------------------
def host_all_gather(x: torch.Tensor, group_size: int, pg: dist.ProcessGroup) -> torch.Tensor:
    x = x.reshape(1) if x.dim() == 0 else x.contiguous()
    out = x.new_empty((group_size * x.shape[0], *x.shape[1:]))
    if out.numel():
        dist.all_gather(list(out.chunk(group_size)), x, group=pg)
    return out


def host_reduce(x: torch.Tensor, op: str, pg: dist.ProcessGroup) -> torch.Tensor:
    if op not in _REDUCE:
        raise ValueError(f"stand-in collectives: reduce op {op!r} is not supported; valid: {', '.join(_REDUCE)}")
    t = x.contiguous().clone()
    if t.numel():
        dist.all_reduce(t, op=_REDUCE[op], group=pg)
        if op == "avg":
            t = t / pg.size() if t.is_floating_point() else t // pg.size()
    return t


def host_reduce_scatter(x: torch.Tensor, op: str, group_size: int, pg: dist.ProcessGroup) -> torch.Tensor:
    if x.dim() == 0 or x.shape[0] % group_size:
        raise ValueError(f"reduce_scatter_tensor: dim 0 of shape {tuple(x.shape)} must be divisible by the group size "
                         f"{group_size}")
    return host_reduce(x, op, pg).chunk(group_size)[pg.rank()].clone()


def host_broadcast(x: torch.Tensor, src: int, pg: dist.ProcessGroup) -> torch.Tensor:
    t = x.contiguous().clone()
    dist.broadcast(t, src=src, group=pg)
    return t


def host_all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                    pg: dist.ProcessGroup) -> torch.Tensor:
    rows = sum(out_splits) if out_splits else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits) or None, list(in_splits) or None, group=pg)
    return out


# ---- the Work whose wait() completes the collective -------------------------------------------------
class DeferredWork(dist.Work):
    """Registered for a poisoned output: ``wait()`` runs ``complete`` once (the collective and the
    write of the result; on CUDA it returns the event the result is written behind) and, on CUDA,
    makes the current stream wait for that event, on every call."""

    def __init__(self, complete: Callable[[], Any], stats: "Stats") -> None:
        super().__init__()
        self._complete: Optional[Callable[[], Any]] = complete
        self._done: Any = None
        self._stats = stats
        stats.works += 1

    def wait(self, timeout: Any = None) -> bool:
        if self._complete is not None:
            complete, self._complete = self._complete, None
            self._done = complete()
            self._stats.waited += 1
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        return True


@dataclass
class Stats:
    """What the stand-in served: ops issued by name, Works created and waited."""

    issued: Counter = field(default_factory=Counter)
    works: int = 0
    waited: int = 0

    def snapshot(self) -> dict[str, Any]:
        return {"issued": dict(self.issued), "works": self.works, "waited": self.waited,
                "never_waited": self.works - self.waited}

    def since(self, before: dict[str, Any]) -> dict[str, Any]:
        """What was served after ``before`` (a ``snapshot()``)."""
        now = self.snapshot()
        issued = {k: v - before["issued"].get(k, 0) for k, v in now["issued"].items() if v - before["issued"].get(k, 0)}
        works, waited = now["works"] - before["works"], now["waited"] - before["waited"]
        return {"issued": issued, "works": works, "waited": waited, "never_waited": works - waited}


@contextlib.contextmanager
def sync_debug_off() -> Iterator[None]:
    """The stand-in's host phase is not counted by ``torch.cuda.set_sync_debug_mode`` (NCCL has
    none: the check counts the engine's synchronisations, not the stand-in's)."""
    mode = torch.cuda.get_sync_debug_mode()
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory, so that copies to and from the GPU are asynchronous."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def host_wait(event: Any) -> None:
    """Block the host until ``event`` completed, by polling ``query()``: unlike ``synchronize()``
    this is invisible to the CUDA sanitizer (which would otherwise order every stream after the
    input copy, as a real synchronisation does, hiding races that NCCL, which never synchronises
    the host, would have) and to the sync debug mode."""
    spins = 0
    while not event.query():
        spins += 1
        time.sleep(0 if spins < 1000 else 1e-4)


class StandIn:
    """The stand-in kernels for ``device`` ("cpu" or "cuda"); ``install()`` registers them,
    ``uninstall()`` gives torch's (and the engine's) kernels back. ``result_delay_cycles``: on
    CUDA, how long the result stream sleeps before it writes a result (``torch.cuda._sleep``
    cycles; 0: no sleep)."""

    def __init__(self, device: str, result_delay_cycles: int = 0) -> None:
        if device not in DEVICES:
            raise ValueError(f"stand-in collectives: device {device!r} is invalid; valid: {', '.join(DEVICES)}")
        if result_delay_cycles < 0:
            raise ValueError(f"stand-in collectives: result_delay_cycles must be >= 0, got {result_delay_cycles}")
        self.device, self.delay = device, int(result_delay_cycles)
        self.stats = Stats()
        self._lib: Optional[torch.library.Library] = None
        self._streams: dict[tuple[str, int], tuple[Any, Any]] = {}  # (group, device index) -> (input, result)

    # ---- registration -----------------------------------------------------------------------
    def install(self) -> "StandIn":
        if self._lib is not None:
            return self
        if self.device == "cpu":
            # the engine's gloo workaround registers CPU kernels for the gathers once per process
            # and refuses to register over ours: let it go first, then override it
            from paro_fsdp._compat import use_safe_gloo_all_gather

            use_safe_gloo_all_gather()
        lib = torch.library.Library("_c10d_functional", "IMPL")
        key = "CPU" if self.device == "cpu" else "CUDA"
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
            warnings.filterwarnings("ignore", message="(?s).*(previously registered kernel|may also be overridden)")
            for name, fn in self._kernels().items():
                lib.impl(name, self._counted(name, fn), key, allow_override=True)
        self._lib = lib
        return self

    def uninstall(self) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None

    def __enter__(self) -> "StandIn":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            self.stats.issued[name] += 1
            return fn(*args, **kwargs)
        return kernel

    def _kernels(self) -> dict[str, Callable[..., Any]]:
        return {
            "all_gather_into_tensor": self._all_gather,
            "all_gather_into_tensor_out": self._all_gather_out,
            "all_gather_into_tensor_coalesced": lambda xs, k, g: [self._all_gather(x, k, g) for x in xs],
            "reduce_scatter_tensor": self._reduce_scatter,
            "reduce_scatter_tensor_out": self._reduce_scatter_out,
            "reduce_scatter_tensor_coalesced": lambda xs, op, k, g: [self._reduce_scatter(x, op, k, g) for x in xs],
            "all_reduce": self._all_reduce,
            "all_reduce_": self._all_reduce_,
            "all_reduce_coalesced": lambda xs, op, g: [self._all_reduce(x, op, g) for x in xs],
            "all_reduce_coalesced_": lambda xs, op, g: [self._all_reduce_(x, op, g) for x in xs],
            "broadcast": self._broadcast,
            "broadcast_": self._broadcast_,
            "all_to_all_single": self._all_to_all,
        }

    # ---- the ops: output, what the collective reads, and the collective on host tensors ----------
    def _all_gather(self, x: torch.Tensor, group_size: int, group_name: Any) -> torch.Tensor:
        shape = (group_size * (x.shape[0] if x.dim() else 1), *x.shape[1:])
        return self._all_gather_out(x, group_size, group_name, out=x.new_empty(shape))

    def _all_gather_out(self, x: torch.Tensor, group_size: int, group_name: Any, *, out: torch.Tensor) -> torch.Tensor:
        pg = self._check_size(group_name, group_size, "all_gather_into_tensor")
        return self._launch(pg, out, x, lambda h: host_all_gather(h, group_size, pg))

    def _reduce_scatter(self, x: torch.Tensor, op: str, group_size: int, group_name: Any) -> torch.Tensor:
        if x.dim() == 0 or x.shape[0] % group_size:
            raise ValueError(f"reduce_scatter_tensor: dim 0 of shape {tuple(x.shape)} must be divisible by the group "
                             f"size {group_size}")
        out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
        return self._reduce_scatter_out(x, op, group_size, group_name, out=out)

    def _reduce_scatter_out(self, x: torch.Tensor, op: str, group_size: int, group_name: Any, *,
                            out: torch.Tensor) -> torch.Tensor:
        pg = self._check_size(group_name, group_size, "reduce_scatter_tensor")
        return self._launch(pg, out, x, lambda h: host_reduce_scatter(h, op, group_size, pg))

    def _all_reduce(self, x: torch.Tensor, op: str, group_name: Any) -> torch.Tensor:
        pg = _group(group_name)
        return self._launch(pg, torch.empty_like(x, memory_format=torch.contiguous_format), x,
                            lambda h: host_reduce(h, op, pg))

    def _all_reduce_(self, x: torch.Tensor, op: str, group_name: Any) -> torch.Tensor:
        pg = _group(group_name)
        return self._launch(pg, x, x, lambda h: host_reduce(h, op, pg), inplace=True)

    def _broadcast(self, x: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
        pg = _group(group_name)
        return self._launch(pg, torch.empty_like(x, memory_format=torch.contiguous_format), x,
                            lambda h: host_broadcast(h, src, pg))

    def _broadcast_(self, x: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
        pg = _group(group_name)
        return self._launch(pg, x, x, lambda h: host_broadcast(h, src, pg), inplace=True)

    def _all_to_all(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                    group_name: Any) -> torch.Tensor:
        pg = _group(group_name)
        rows = sum(int(s) for s in out_splits) if out_splits else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        return self._launch(pg, out, x,
                            lambda h: host_all_to_all(h, [int(s) for s in out_splits], [int(s) for s in in_splits], pg))

    @staticmethod
    def _check_size(group_name: Any, group_size: int, op: str) -> dist.ProcessGroup:
        pg = _group(group_name)
        if pg.size() != group_size:
            raise ValueError(f"{op}: group_size {group_size} but group {group_name!r} has {pg.size()} ranks")
        return pg

    # ---- issue and completion ------------------------------------------------------------------
    def _launch(self, pg: dist.ProcessGroup, out: torch.Tensor, x: torch.Tensor,
                collective: Callable[[torch.Tensor], torch.Tensor], inplace: bool = False) -> torch.Tensor:
        """Poison ``out``, register the Work that completes it, return it."""
        if self.device == "cuda":
            complete = self._issue_cuda(out, x, collective, pg.group_name)
        else:
            complete = self._issue_cpu(out, x, collective, inplace)
        torch._C._distributed_c10d._register_work(out, DeferredWork(complete, self.stats))
        return out

    @staticmethod
    def _issue_cpu(out: torch.Tensor, x: torch.Tensor, collective: Callable[[torch.Tensor], torch.Tensor],
                   inplace: bool) -> Callable[[], None]:
        src = x.clone() if inplace else x  # out-of-place: the input is read at wait(), as late as NCCL may
        with torch.no_grad():
            out.fill_(poison_value(out.dtype))

        def complete() -> None:
            result = collective(src)
            with torch.no_grad():
                out.copy_(result.view(out.shape))
        return complete

    def _issue_cuda(self, out: torch.Tensor, x: torch.Tensor, collective: Callable[[torch.Tensor], torch.Tensor],
                    group: str) -> Callable[[], Any]:
        issuing = torch.cuda.current_stream(out.device)
        in_stream, result_stream = self._streams_of(out, group)
        in_stream.wait_stream(issuing)
        with torch.no_grad(), torch.cuda.stream(in_stream):
            host = pinned_empty(x.shape, x.dtype)
            host.copy_(x, non_blocking=True)  # x may be out itself (in-place ops): read before the poison
            out.fill_(poison_value(out.dtype))
            copied = in_stream.record_event()
        delay = self.delay

        def complete() -> Any:
            with sync_debug_off(), torch.no_grad():
                host_wait(copied)
                result = collective(host).view(out.shape)
                pinned = result.pin_memory()
                result_stream.wait_event(copied)  # the poison is written before the result
                with torch.cuda.stream(result_stream):
                    if delay:
                        torch.cuda._sleep(delay)
                    out.copy_(pinned, non_blocking=True)
                    return result_stream.record_event()
        return complete

    def _streams_of(self, out: torch.Tensor, group: str) -> tuple[Any, Any]:
        """The input and result streams of one process group on the output's device (NCCL has
        one stream per process group and device)."""
        key = (group, out.device.index or 0)
        if key not in self._streams:
            self._streams[key] = (torch.cuda.Stream(out.device), torch.cuda.Stream(out.device))
        return self._streams[key]
