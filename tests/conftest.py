"""The tests' shared harness lives in ``tests/harness/`` (the gloo world on `tools/local_world.py`,
the tiny workloads, hostile pickles, Hugging Face folders, torchtitan's CPU shims); the test
files import its modules by name (``from dist_harness import run_world``).

Both folders go on ``sys.path`` here, before any test module is imported: the ranks of a world
take the parent's ``sys.path`` when they start (the fork server sends it with each process), and
import their function by name, ``"test_<feature>:<function>"``, so a test file's own rank code
and the harness it uses resolve inside every rank as they do in pytest."""
from __future__ import annotations

import sys
import os
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
for folder in (TESTS / "harness", TESTS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# strategy="auto" keeps what it calibrates (paro_fsdp/cost/calibration_cache.py): a test run keeps
# it in a folder of its own, so no run reads another's (or the user's ~/.cache) and passes by it.
if "PARO_FSDP_CACHE_DIR" not in os.environ:
    import atexit
    import shutil

    os.environ["PARO_FSDP_CACHE_DIR"] = tempfile.mkdtemp(prefix="paro-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PARO_FSDP_CACHE_DIR"], ignore_errors=True)
