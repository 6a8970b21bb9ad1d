"""Where collectives are issued on a GPU: two side streams, as FSDP2 does.

Why: a collective issued from the compute stream starts only after every kernel queued before it,
and PaRO-CC's later phases, issued at the consumer's ``wait()``, would queue behind all compute
issued by then. So on CUDA all-gathers run on ``gather`` and reductions on ``reduce`` (both high
priority): the side stream first waits for the compute stream (which wrote the input), every phase
is issued at once there (each after the one before through a stream-side ``wait_tensor``), and the
consumer waits for an event recorded after the last (``Pending.wait``). No ``record_stream``: the
``Pending`` holds the input until the compute stream has waited, and outputs, allocated on the side
stream, are consumed before the next issue of that kind (``drive`` keeps results referenced).

On CPU (gloo) ``wait_tensor`` blocks the thread, so later phases stay inside ``wait()`` and
``streams_for`` returns None; while torch.compile traces, the graph passes schedule instead.
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
