"""The tests' shared harness lives in ``tests/harness/`` (the gloo world on `tools/local_world.py`,
the tiny workloads, hostile pickles, Hugging Face folders, torchtitan's CPU shims); the test
files import its modules by name (``from dist_harness import run_world``).

Both folders go on ``sys.path`` here, before any test module is imported: the ranks of a world
take the parent's ``sys.path`` when they start (the fork server sends it with each process), and
import their function by name, ``"test_<feature>:<function>"``, so a test file's own rank code
and the harness it uses resolve inside every rank as they do in pytest."""
from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
for folder in (TESTS / "harness", TESTS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
