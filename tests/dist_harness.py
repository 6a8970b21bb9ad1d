"""Run a function on N real gloo ranks in fresh processes, once per test module.

A world starts in a fraction of a second (ranks fork from a server with torch imported), but
each case's setup still costs, so a module starts its world once and runs every case inside it;
results come back from every rank (``paro_fsdp.local_world``, shared with the local calibration).
"""
from __future__ import annotations

from tools.local_world import run_local_world as run_world

__all__ = ["run_world"]
