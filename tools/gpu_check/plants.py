"""Bugs planted on purpose, to prove that part (d) fails when the engine's stream protocol is
broken (``--plant``, and part (d)'s self-test rows).

* ``missing-wait``: the consumer does not wait for a collective. ``comm.Pending.wait`` returns its
  tensor as it is (on CPU without ``wait_tensor``, on CUDA without making the consumer's stream
  wait for the side stream's event), and ``streams.CommStreams.wait`` does nothing (on CUDA the
  consumer's wait of every PaRO-CC result too); on CPU, where PaRO-CC waits each phase on the
  host, its phases skip ``wait_tensor`` (``paro_cc._wait``). The stand-in then hands the consumer
  a poisoned (NaN) buffer: on CPU always, on CUDA while its result stream still sleeps. (NNN and
  GGG move everything through PaRO-CC; the clip's all-reduce, which once caught them on CPU, is
  DTensor's now: torch's ``clip_grad_norm_`` over the parameters.)
* ``issue-wait`` (CUDA only: CPU has no streams): ``streams.CommStreams.issue`` enters the side
  stream without making it wait for the compute stream first, so a collective reads its input
  (a gradient, the clipped masters) before the lagging compute stream has written it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional
from unittest import mock

PLANTS = ("missing-wait", "issue-wait")
CUDA_ONLY = ("issue-wait",)


def plant_error(name: Optional[str], device: str) -> Optional[str]:
    """One line saying why ``name`` cannot be planted on ``device``; None when it can."""
    if name is None:
        return None
    if name not in PLANTS:
        return f"--plant {name!r} is invalid; valid: {', '.join(PLANTS)}"
    if name in CUDA_ONLY and device != "cuda":
        return f"--plant {name} needs CUDA streams; on {device} there is nothing to plant (valid there: missing-wait)"
    return None


def _pending_without_wait(self: Any) -> Any:
    return self.tensor


@contextlib.contextmanager
def _issue_without_wait(self: Any, kind: str) -> Iterator[Any]:
    import torch

    side = self.stream(kind)
    with torch.cuda.stream(side):
        yield side


@contextlib.contextmanager
def planted(name: Optional[str], device: str) -> Iterator[None]:
    """Run the body with the bug ``name`` planted in the engine (nothing for None)."""
    err = plant_error(name, device)
    if err:
        raise ValueError(err)
    if name is None:
        yield
        return
    from paro_fsdp import comm, paro_cc, streams

    with contextlib.ExitStack() as stack:
        if name == "missing-wait":
            stack.enter_context(mock.patch.object(comm.Pending, "wait", _pending_without_wait))
            stack.enter_context(mock.patch.object(streams.CommStreams, "wait", staticmethod(lambda event: None)))
            if device != "cuda":  # on CUDA the side streams' waits above are the consumer's
                stack.enter_context(mock.patch.object(paro_cc, "_wait", lambda t: t))
        else:
            stack.enter_context(mock.patch.object(streams.CommStreams, "issue", _issue_without_wait))
        yield
