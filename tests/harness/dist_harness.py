"""Run a function on N real gloo ranks in fresh processes, once per test module.

A world starts in a fraction of a second (ranks fork from a server with torch imported), but
each case's setup still costs, so a module starts its world once and runs every case inside it;
results come back from every rank (``tools.local_world``, shared with the local calibration).

The function is a test file's own top-level rank function (``run_world(4, rank_main, ...)``),
or named as ``"module:function"``. Each rank imports it by its module's name with the parent's
``sys.path`` (the fork server sends it with every process): ``tests/conftest.py`` puts
``tests/`` and ``tests/harness/`` there, and a function's own folder is added here, so a test
module imported some other way resolves in the ranks too.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Union

from tools.local_world import run_local_world

__all__ = ["run_world"]


def target_of(fn: Callable[[Any], Any]) -> str:
    """``"module:function"`` for a module-level function the ranks can import."""
    module = sys.modules.get(fn.__module__)
    if module is None or getattr(module, fn.__name__, None) is not fn:
        raise ValueError(
            f"{fn.__qualname__} is not a top-level function of an imported module: ranks import it by name"
        )
    folder = os.path.dirname(os.path.abspath(module.__file__))
    if folder not in sys.path:
        sys.path.append(folder)
    return f"{fn.__module__}:{fn.__name__}"


def run_world(
    world: int, target: Union[str, Callable[[Any], Any]], payload: Any = None, timeout: float = 900
) -> list[Any]:
    """``target(payload)`` on ``world`` gloo ranks; every rank's result, in rank order."""
    return run_local_world(world, target if isinstance(target, str) else target_of(target), payload, timeout)
