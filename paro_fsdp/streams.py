"""Where collectives are issued on a GPU: two side streams, as FSDP2 does.

Why: a collective issued from the compute stream starts only after every kernel queued before it,
and a multi-phase one (PaRO-CC: inter then intra, or intra then inter) issued its later phases
when the consumer called ``wait()``, i.e. behind all the compute queued by then. So on CUDA:

* all-gathers run on ``gather``, reductions (reduce-scatter, all-reduce) on ``reduce``, both high
  priority. Issuing first makes the side stream wait for the compute stream (the input was
  written there), then every phase is issued at once on the side stream: a later phase follows
  the earlier one through ``wait_tensor`` on the side stream, a stream-side wait on the NCCL
  work's event that never blocks the CPU.
* the consumer waits for an event recorded on the side stream after the last phase
  (``Pending.wait``), so only the consumer, never the compute stream before it, waits.
* buffer lifetimes need no ``record_stream``: an input allocated on the compute stream is held by
  the ``Pending`` until the compute stream has waited for the side stream; outputs are allocated
  on the side stream, and every later issue on that stream first waits for the compute stream,
  which by then has consumed the previous output (the engine consumes each result before it
  issues the next collective of the same kind; ``drive`` keeps every result referenced until it
  is consumed).

On CPU (gloo) ``wait_tensor`` blocks the calling thread, so there the later phases stay where
they were: issued inside ``wait()`` (see ``paro_cc``); ``streams_for`` returns None. Under
torch.compile the graph passes schedule collectives, so no side stream is entered while tracing.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

KINDS = ("gather", "reduce")


class CommStreams:
    """The two side streams of one model, and the issue context."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gather = torch.cuda.Stream(device, priority=-1)
        self.reduce = torch.cuda.Stream(device, priority=-1)

    def stream(self, kind: str) -> torch.cuda.Stream:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.gather if kind == "gather" else self.reduce

    @contextlib.contextmanager
    def issue(self, kind: str) -> Iterator[torch.cuda.Stream]:
        """Run the body on the ``kind`` stream, after everything queued on the current stream."""
        side = self.stream(kind)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield side

    @staticmethod
    def wait(event: torch.cuda.Event) -> None:
        """Make the current (consumer) stream wait for ``event``."""
        torch.cuda.current_stream().wait_event(event)


def streams_for(device: torch.device) -> CommStreams | None:
    """Side streams for a CUDA device; None elsewhere (CPU, meta)."""
    return CommStreams(device) if device.type == "cuda" else None


def active(streams: CommStreams | None) -> CommStreams | None:
    """The streams to issue on now: none while torch.compile traces (the graph decides)."""
    if streams is None or torch.compiler.is_compiling():
        return None
    return streams
