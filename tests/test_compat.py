"""The torch workarounds of ``paro_fsdp/_compat.py``: each test fails if its workaround goes.

(The gloo all-gather kernel is tested by tests/test_gloo_concurrency.py.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parent.parent

_ROOFLINE = r"""
import sys
import torch
import torch._inductor.fx_passes.overlap_scheduling as overlap
from torch.fx.experimental.proxy_tensor import make_fx
from paro_fsdp._compat import roofline_name

roofline = lambda node: getattr(overlap, roofline_name())(node)  # looked up at call time, as torch does

gm = make_fx(lambda a, b: a @ b, tracing_mode="fake")(torch.randn(64, 32), torch.randn(32, 16))
mm = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
if sys.argv[1] == "ours":
    from passes.runtime import disable_overlap_scheduler, enable_overlap_scheduler
    estimate = enable_overlap_scheduler("a100_ib")
    got = roofline(mm)  # what the scheduler calls, by module lookup
    assert got == estimate(mm) > 0, got
    disable_overlap_scheduler()
try:
    roofline(mm)
except Exception as e:  # torch's own roofline on a machine without a GPU
    print("torch-roofline-failed", type(e).__name__)
else:
    print("torch-roofline-ran")
"""


def _roofline(mode: str) -> str:
    r = subprocess.run([sys.executable, "-c", _ROOFLINE, mode], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_overlap_scheduler_prices_compute_with_our_estimate():
    """route_roofline_estimate: the scheduler's roofline lookup returns our estimate, and
    disable restores torch's own function."""
    import torch

    result = _roofline("ours")  # fails inside if the scheduler's lookup does not reach our estimate
    if not torch.cuda.is_available():  # the bug: torch's own roofline asks for a GPU's DRAM bandwidth
        assert result.startswith("torch-roofline-failed"), result


def test_each_rank_caches_its_own_graphs_and_shares_kernels(monkeypatch, tmp_path):
    """isolate_compile_cache: rank r's FX-graph and AOTAutograd caches are folders of their own,
    the kernels' builds stay in the shared folder (each kernel built once per machine), and a
    second call (another rank number too) does not nest the folders."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from paro_fsdp._compat import isolate_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for cache in (FxGraphCache, AOTAutogradCache):
        monkeypatch.setattr(cache, "_get_tmp_dir", cache.__dict__["_get_tmp_dir"])  # undone after the test
    isolate_compile_cache(3)
    isolate_compile_cache(3)
    assert cache_dir() == str(tmp_path)
    assert FxGraphCache._get_tmp_dir() == str(tmp_path / "fxgraph" / "paro-rank3")
    assert AOTAutogradCache._get_tmp_dir() == str(tmp_path / "aotautograd" / "paro-rank3")
    isolate_compile_cache(0)
    assert FxGraphCache._get_tmp_dir_for_key("abcdef") == str(tmp_path / "fxgraph" / "paro-rank0" / "bc" / "abcdef")
    assert AOTAutogradCache._get_tmp_dir() == str(tmp_path / "aotautograd" / "paro-rank0")


_RENAMED = r"""
import os, warnings
import torch, torch.distributed as dist
from paro_fsdp import _compat

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # the deprecated alias of 2.13+ warns on every call
    out = torch.empty(3)
    _compat.all_gather_single(out, torch.arange(3.0))
    red = torch.empty(3)
    _compat.reduce_scatter_single(red, torch.arange(3.0))
assert out.tolist() == [0.0, 1.0, 2.0] and red.tolist() == [0.0, 1.0, 2.0], (out, red)
dist.destroy_process_group()
print("ok", torch.__version__)
"""


def test_renamed_collectives_resolve_on_this_torch():
    """all_gather_single / reduce_scatter_single: the 2.13 names where torch has them (no
    deprecation warning per call), the 2.11 / 2.12 names below that (no AttributeError)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", _RENAMED], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PORT": str(port)})
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


def test_supported_range_matches_pyproject():
    """SUPPORTED_TORCH's lower bound is the one pyproject.toml declares, and this torch is inside it."""
    import re

    from paro_fsdp._compat import SUPPORTED_TORCH, torch_version

    text = (ROOT / "pyproject.toml").read_text()
    low = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert low and (int(low.group(1)), int(low.group(2))) == SUPPORTED_TORCH[0]
    assert SUPPORTED_TORCH[0] <= torch_version() <= SUPPORTED_TORCH[1]
