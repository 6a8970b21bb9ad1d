"""Inductor's ``reorder_for_peak_memory`` off for the engine's graphs only, as the user set it for
every other graph in the process.

The setting re-sorts the scheduled nodes by peak memory, which put every prefetched all-gather
of the reorder pass back next to its use. Why it is scoped this way: inductor reads it once per
graph, in ``Scheduler.__init__`` (torch/_inductor/scheduler.py), after the post-grad passes, and
runs no hook after that read (its scheduler hooks ``_pre_fusion_custom_pass`` and
``_post_fusion_custom_pass`` run before it), so nothing can undo a change, or exit a
``config.patch``, right after one graph is scheduled. What is possible: the post-grad pass,
which inductor runs on every graph it compiles while the pass is installed (or given to
``torch.compile(options=...)``), sets it just before that graph is scheduled (off for an engine
graph, back to the value before for any other), and dynamo's compile-end callback puts back the
value the user had when the compile (a frame, or a backward compiled lazily) started, after any
``config.patch`` of that compile has exited. So it reads off only from an engine graph's
post-grad pass to the end of its compile; a graph compiled after it in the same compile gets an
FX-graph-cache key that says off, though the pass schedules it with the user's value. A compile
without dynamo (``torch._inductor.compile``) has no end callback: there the setting stays off
until the next graph's post-grad pass.
"""
from __future__ import annotations

import torch

KEY = "reorder_for_peak_memory"


class PeakMemoryScope:
    def __init__(self) -> None:
        self.outside: bool | None = None  # the user's value when this compile started (None: unknown)
        self.before: bool | None = None  # the value an engine graph of this compile turned off (None: on)

    def graph(self, engine: bool) -> None:
        """Set the value for the graph inductor schedules next: ``engine`` graphs get it off."""
        cfg = torch._inductor.config
        self._hook()
        if engine:
            if self.before is None:
                self.before = getattr(cfg, KEY)
            setattr(cfg, KEY, False)
        elif self.before is not None:
            setattr(cfg, KEY, self.before)
            self.before = None

    def start(self, *_) -> None:
        self.outside = getattr(torch._inductor.config, KEY)

    def end(self, *_) -> None:
        if self.before is not None:
            setattr(torch._inductor.config, KEY, self.before if self.outside is None else self.outside)
        self.outside = self.before = None

    def _hook(self) -> None:
        """Register with dynamo's compile callbacks (again after ``torch._dynamo.reset()``, which
        clears them; the next compile's start is then the first one read)."""
        from torch._dynamo.callback import callback_handler

        if self.end not in callback_handler.end_callbacks:
            callback_handler.register_start_callback(self.start)
            callback_handler.register_end_callback(self.end)


#: one for the process: the setting is one value, whichever ParoPasses turns it off
peak_memory = PeakMemoryScope()
