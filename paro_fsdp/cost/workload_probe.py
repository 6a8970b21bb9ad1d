"""The workload ``strategy="auto"`` plans for, seen from the model: the activations of one
micro-step measured before it is sharded (when the workload gives ``example_inputs``), and the
first step checked against what the plan assumed.

Why measured: the cost model's activation formula holds for Llama-shaped models only; for any
other model a plan whose peak leaves them out runs out of memory where activations dominate (a GPU).

How: one forward and backward of ``example_inputs`` under ``FakeTensorMode`` (shapes only), the
parameters fake ones in the working dtype, inside torch's ``MemTracker``: its ``Activation`` +
``Temp`` bytes at the peak (checkpointing and recomputation included). Each parameter's gradient
is dropped as it accumulates (the ledger prices the engine's). The loss is the output's ``loss``,
else ``loss_fn(output)`` (its transients measured too), else the sum of the first floating output.

Where the fake forward cannot run (a fake kernel that refuses a dtype: torch's ``grouped_mm`` in
fp32, a mixture of experts; control flow on a tensor's values) one real forward and backward of the
micro-batch measures the same under ``MemTracker``, on the parameters' own storage; a model on the
meta device has none to run, and is asked for ``Workload(activation_bytes=...)`` in one line. Tied
parameters are one tensor: each is passed once, ``functional_call`` ties its other names.

Three numbers, one per moment of the engine's backward (``cost.ledger.backward_moments``): the
activations' own peak, the most held while a block's backward runs and when it has finished, each
the most over the blocks. A model whose parameters are about its activations' size peaks at the last.
"""
from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

__all__ = ["MeasuredActivations", "measure_activations", "tokens_shape", "watch_first_step"]


@dataclass(frozen=True)
class MeasuredActivations:
    """``activation_bytes``: one micro-step's peak; ``in_backward`` / ``after_backward``: the most while a
    block's backward runs / when it has finished; ``micro_batch`` / ``seq_len``: from the inputs; ``method``:
    the measurement that ran (a fake forward, or a real one where the fake one failed, and why)."""

    activation_bytes: float
    in_backward: float
    after_backward: float
    micro_batch: int
    seq_len: int
    method: str = "a fake forward"


def tokens_shape(args: tuple, kwargs: dict) -> Optional[tuple[int, int]]:
    """(batch, sequence) of a micro-batch: the first integer tensor of two or more dimensions (token
    ids), else the first tensor's leading dimension and 1; None without tensors."""
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    for t in tensors:
        if not t.is_floating_point() and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
    return (int(tensors[0].shape[0]) if tensors[0].dim() else 1, 1) if tensors else None


def as_call(example_inputs: Any) -> tuple[tuple, dict]:
    """``example_inputs`` (a tensor, positional arguments, or a dict of keyword arguments) as (args, kwargs)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise TypeError(f"Workload(example_inputs=...) takes one micro-batch as a tensor, a tuple of the forward's "
                    f"arguments or a dict of its keyword arguments, got {type(example_inputs).__name__}")


def _loss(out: Any, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if loss_fn is not None:
        return loss_fn(out)
    stack = [out]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
            return x.float().sum()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif hasattr(x, "__dataclass_fields__") or hasattr(x, "to_tuple"):
            stack.extend(vars(x).values())
    raise _UserError(f"Workload(example_inputs=...): the model's output ({type(out).__name__}) has no loss and no "
                     f"floating tensor that needs a gradient to run a backward from; pass "
                     f"Workload(loss_fn=<output -> loss>) or Workload(activation_bytes=...) instead")


def measure_activations(model: nn.Module, example_inputs: Any, param_dtype: torch.dtype,
                        blocks: Sequence[nn.Module] = (),
                        loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> MeasuredActivations:
    """One micro-step's activations (module docstring); ``blocks``: the modules sharded apart (their
    backwards' ends are the moments). The fake forward allocates nothing; where it cannot run (a fake
    kernel that refuses a dtype, control flow on a tensor's values) one real forward and backward
    measures instead, the parameters' own storage where their dtype is ``param_dtype``, the model's
    buffers and random state restored after it (``method`` says which ran)."""
    with _buffers_kept(model):
        return _measure(model, example_inputs, param_dtype, blocks, loss_fn)


def _measure(model: nn.Module, example_inputs: Any, param_dtype: torch.dtype, blocks: Sequence[nn.Module],
             loss_fn: Optional[Callable[[Any], torch.Tensor]]) -> MeasuredActivations:
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = as_call(example_inputs)
    shape = tokens_shape(args, kwargs) or (1, 1)
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs a failing fake kernel's whole stack
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            def fake_like(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
                return torch.empty(t.shape, dtype=dtype or t.dtype,
                                   device="cpu" if t.device.type == "meta" else t.device)

            params = _params(model, lambda p, dtype: fake_like(p, dtype), param_dtype)
            inputs = tuple(fake.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args)
            kw = {k: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            acts, inside, after = _track(model, params, inputs, kw, blocks, loss_fn)
        return MeasuredActivations(acts, inside, after, *shape, "a fake forward")
    except _UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any kernel or trace failure: measured for real below
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:160]
    finally:
        quiet.setLevel(level)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError(f"Workload(example_inputs=...): {type(model).__name__}'s fake forward failed ({why}) and its "
                         f"parameters are on the meta device, so no real forward can measure it; pass "
                         f"Workload(activation_bytes=<one micro-step's activation bytes per rank>)")
    acts, inside, after = _real(model, args, kwargs, blocks, loss_fn, param_dtype)
    return MeasuredActivations(acts, inside, after, *shape, f"a real forward and backward (the fake one failed: {why})")


class _UserError(ValueError):
    """A workload the model cannot run from (no loss): a real forward would fail alike."""


def _params(model: nn.Module, like: Callable[[torch.Tensor, Optional[torch.dtype]], torch.Tensor],
            param_dtype: torch.dtype) -> dict[str, nn.Parameter]:
    """The model's parameters by name, each once (a tied one is one tensor: ``functional_call`` ties its
    other names), made by ``like(p, dtype)``, the floating ones in ``param_dtype``."""
    out: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():
        q = nn.Parameter(like(p, param_dtype if p.is_floating_point() else None), requires_grad=p.requires_grad)
        if q.requires_grad:  # the gradient leaves as it lands: the peak is the activations'
            q.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))
        out[name] = q
    return out


def _real(model: nn.Module, args: tuple, kwargs: dict, blocks: Sequence[nn.Module],
          loss_fn: Optional[Callable[[Any], torch.Tensor]], param_dtype: torch.dtype) -> tuple[float, float, float]:
    """``_track`` on real tensors: the parameters' own storage (a cast copy where the dtype differs), the
    random state as it was before (dropout), the model's ``.grad`` untouched."""
    devices = sorted({t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        params = _params(model, lambda p, dtype: p.detach() if dtype in (None, p.dtype) else p.detach().to(dtype),
                         param_dtype)
        return _track(model, params, args, kwargs, blocks, loss_fn)


@contextmanager
def _buffers_kept(model: nn.Module):
    """The model's buffers as they were (BatchNorm's statistics: a fake forward moves its real counter too)."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in saved:
                    b.copy_(saved[name])


def _track(model: nn.Module, params: dict[str, nn.Parameter], args: tuple, kwargs: dict,
           blocks: Sequence[nn.Module], loss_fn: Optional[Callable[[Any], torch.Tensor]]) -> tuple[float, float, float]:
    """One forward and backward inside torch's ``MemTracker``: the activations' peak, and the most inside /
    after a block's backward."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.func import functional_call
    from torch.utils.hooks import RemovableHandle

    tracker = MemTracker()
    # MemTracker hooks every parameter's gradient; a frozen one (LoRA's base) cannot take a hook: no-op handles
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    if handles is not None:
        for q in params.values():
            if not q.requires_grad:
                handles[q] = (RemovableHandle(OrderedDict()), RemovableHandle(OrderedDict()))
    with tracker:
        with warnings.catch_warnings():  # MemTracker's gradient hook warns on the gradients dropped
            warnings.simplefilter("ignore", UserWarning)
            _loss(functional_call(model, params, args, kwargs, tie_weights=True, strict=False),
                  loss_fn).backward()  # the output not held through the backward (a user's loop drops it)
    acts = _activations(tracker.get_tracker_snapshot("peak"))
    inside, after = ([_activations(snap) for b in blocks if b in tracker.memory_tracking
                      for snap in tracker.memory_tracking[b].snapshots.get(state, [])]
                     for state in (_ModState.PEAK_BW, _ModState.POST_BW))
    return acts, max(inside, default=acts), max(after, default=acts)


def _activations(snapshot: dict) -> float:
    """Activation and temporary bytes of a MemTracker snapshot ({device: {kind: bytes}})."""
    return sum(float(by_kind.get(kind, 0)) for by_kind in snapshot.values() for kind in by_kind
               if str(getattr(kind, "value", kind)) in ("Activation", "Temp"))


def watch_first_step(model: nn.Module, micro_batch: int, seq_len: int, grad_accum: int, announce: bool) -> None:
    """Warn once, naming the workload to pass, where the first step differs from the plan's workload:
    the micro-batch's shape and the micro-steps per step. ``announce``: this rank warns (rank 0)."""
    seen: dict[str, Any] = {"forwards": 0}

    def pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["forwards"] += 1
        if seen["forwards"] == 1:
            seen["shape"] = tokens_shape(args, kwargs)
        groups = module._paro_groups(True) if hasattr(module, "_paro_groups") else []
        if groups and not all(g.last_backward for g in groups):
            return  # a micro-step that accumulates: the step goes on
        handle.remove()
        shape, steps = seen.get("shape"), seen["forwards"]
        same_shape = shape is None or (shape[0] == micro_batch and shape[1] in (seq_len, seq_len + 1))
        if announce and (not same_shape or steps != grad_accum):
            ran = f"micro-batch {shape[0]} x {shape[1]}" if shape else "its micro-batch"
            warnings.warn(f"paro auto: the plan was made for micro-batch {micro_batch} x {seq_len} and {grad_accum} "
                          f"micro-steps per step, the first step ran {ran} and {steps}: its predicted peak and step "
                          f"time are another workload's; pass workload=Workload(example_inputs=<one micro-batch>, "
                          f"grad_accum={steps}) to plan for this one", stacklevel=2)

    handle = model.register_forward_pre_hook(pre_forward, with_kwargs=True)
