"""Where collectives are issued on a GPU: two side streams, as FSDP2 does.

Why: a collective issued from the compute stream starts only after every kernel queued before it,
and PaRO-CC's later phases would queue behind all of them. The rules: docs/ARCHITECTURE.md, "On a
GPU". On CPU (gloo) ``wait_tensor`` blocks the thread, so ``streams_for`` returns None.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Iterator

import torch

KINDS = ("gather", "reduce", "params")


class CommStreams:
    """The two side streams of one model, the issue context, and the parameter gathers' results
    kept until the gather stream has waited for their copy-outs."""

    def __init__(self, device: torch.device, slack: int = 1) -> None:
        self.device = device
        self.gather = torch.cuda.Stream(device, priority=-1)
        self.reduce = torch.cuda.Stream(device, priority=-1)
        self.slack = slack
        self._written = False  # params_written has run: until then "params" waits as "gather" does
        self._copied: deque[tuple[torch.cuda.Event, object]] = deque()  # a result: a tensor or its chunks

    def stream(self, kind: str) -> torch.cuda.Stream:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.reduce if kind == "reduce" else self.gather

    @contextlib.contextmanager
    def issue(self, kind: str) -> Iterator[torch.cuda.Stream]:
        """Run the body on the ``kind`` stream: "gather" and "reduce" after everything queued on
        the current stream (which wrote the input); "params", a micro-step's parameter gather,
        whose input is written only between forwards (``params_written``), after the copy-outs
        beyond ``slack`` of the results whose memory it may reuse (FSDP2's ``AllGatherState``):
        with the prefetch, block i+1's gather waits for block i-1's copy-out, not its compute."""
        side = self.stream(kind)
        if kind == "params" and self._written:
            self._drop(side, self.slack)
        else:
            self._wait_current(side)
        with torch.cuda.stream(side):
            yield side

    def params_written(self) -> None:
        """P may have been written on the current stream up to here: later parameter gathers follow."""
        self._wait_current(self.gather)
        self._written = True

    def copied_out(self, gathered: object) -> None:
        """Keep ``gathered`` until the gather stream has waited for the reads queued on the current stream."""
        self._copied.append((torch.cuda.current_stream(self.device).record_event(), gathered))

    def release(self) -> None:
        """Free every kept result (end of backward), the gather stream waiting for its reads."""
        self._drop(self.gather, 0)

    def _wait_current(self, side: torch.cuda.Stream) -> None:
        side.wait_stream(torch.cuda.current_stream(self.device))
        if side is self.gather:  # every copy-out so far is behind that wait
            self._copied.clear()

    def _drop(self, side: torch.cuda.Stream, keep: int) -> None:
        while len(self._copied) > keep:
            side.wait_event(self._copied.popleft()[0])

    @staticmethod
    def wait(event: torch.cuda.Event) -> None:
        torch.cuda.current_stream().wait_event(event)


def streams_for(device: torch.device) -> CommStreams | None:
    return CommStreams(device) if device.type == "cuda" else None


def active(streams: CommStreams | None) -> CommStreams | None:
    """The streams to issue on now: none while torch.compile traces (the graph decides)."""
    return None if streams is None or torch.compiler.is_compiling() else streams
