"""Run a function on N real gloo ranks in fresh processes, once per test module.

Process start costs seconds per rank here, so a module spawns its world once and runs every
case inside it; results come back from every rank (``paro_fsdp.local_world``, shared with the
local calibration).
"""
from __future__ import annotations

from paro_fsdp.local_world import run_local_world as run_world

__all__ = ["run_world"]
