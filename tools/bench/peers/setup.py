"""``python -m tools.bench.peers setup``: one venv per pinned release under ``.venv-peers/``.

Per release: ``python -m venv``, then torch pinned to .venv's version first (pip then never swaps
it for another build), setuptools and wheel, then the release with ``--no-build-isolation`` (the
DeepSpeed sdist imports torch in its setup.py) and, for DeepSpeed, ``DS_BUILD_OPS=0`` (no C++ /
CUDA op is built ahead; none is used here). The venvs run the repository's own code from its
root (``python -m tools.bench.peers.worker``), so the project itself is not installed in them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from . import RELEASES, TORCH_PIN, venv_path, venv_python


def _run(argv: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, env=env)


def build(release: str, force: bool = False, python: str | None = None) -> str:
    """Build (or, with ``force``, rebuild) one release's venv; returns its python."""
    rel, path, py = RELEASES[release], venv_path(release), venv_python(release)
    if force and os.path.exists(path):
        shutil.rmtree(path)
    if not os.path.exists(py):
        _run([python or sys.executable, "-m", "venv", path])
    pip = [py, "-m", "pip", "install", "-q"]
    _run(pip + [TORCH_PIN, "setuptools", "wheel"])
    env = dict(os.environ, **dict(rel.env))
    # the torch pin again beside the release: the resolver must keep it, not upgrade it
    _run(pip + ["--no-build-isolation", TORCH_PIN, *rel.pins], env=env)
    _run([py, "-c", f"import torch; assert torch.__version__.startswith('{TORCH_PIN.split('==')[1]}'), "
                    "torch.__version__"])
    return py


def setup(only: list[str] | None = None, force: bool = False) -> int:
    names = only or list(RELEASES)
    bad = [n for n in names if n not in RELEASES]
    if bad:
        print(f"unknown release(s) {','.join(bad)}; valid: {','.join(RELEASES)}", file=sys.stderr)
        return 2
    # the interpreter of .venv (the same minor version as the project's): the venv module of the
    # base python it was made from, so the peers' venvs do not nest inside .venv
    base = getattr(sys, "_base_executable", sys.executable)
    for n in names:
        print(f"== {n}: {', '.join(RELEASES[n].pins)} ({RELEASES[n].why})", flush=True)
        build(n, force, base)
    return 0
