"""Every workaround for a torch bug or gap, in one place.

Each names the bug, the torch versions and the test that fails without it; callers only call the
functions here, so a fixed one goes without other changes.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

#: The torch releases this project supports and tests (``make test-compat``): lowest and highest
#: minor release, inclusive. pyproject.toml declares the same lower bound.
SUPPORTED_TORCH = ((2, 11), (2, 14))


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch (``2.11.0+cu130`` -> (2, 11))."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)

# ---- 0. renamed collectives -------------------------------------------------------------------
#: ``dist.all_gather_single`` (torch >= 2.13) is 2.11 / 2.12's ``dist.all_gather_into_tensor``
#: renamed (the old name warns per call in 2.13). Test: tests/test_compat.py.
all_gather_single: Callable = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: ``dist.reduce_scatter_single`` (torch >= 2.13) is ``dist.reduce_scatter_tensor`` of 2.11 / 2.12.
reduce_scatter_single: Callable = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# ---- 1. gloo: the functional all-gather through the single-tensor path -----------------------
_GLOO_LIB: torch.library.Library | None = None


def _group(group_name) -> dist.ProcessGroup:
    return group_name if isinstance(group_name, dist.ProcessGroup) else _resolve_process_group(group_name)


def _all_gather_out_cpu(shard: torch.Tensor, group_size: int, group_name, *, out: torch.Tensor) -> torch.Tensor:
    work = all_gather_single(out, shard.contiguous(), group=_group(group_name), async_op=True)
    torch._C._distributed_c10d._register_work(out, work)
    return out


def _all_gather_cpu(shard: torch.Tensor, group_size: int, group_name) -> torch.Tensor:
    out = shard.new_empty((shard.shape[0] * group_size, *shard.shape[1:]))
    return _all_gather_out_cpu(shard, group_size, group_name, out=out)


def _all_gather_coalesced_cpu(shards: list[torch.Tensor], group_size: int, group_name) -> list[torch.Tensor]:
    return [_all_gather_cpu(s, group_size, group_name) for s in shards]


def use_safe_gloo_all_gather() -> None:
    """On CPU, run the functional all-gather through gloo's single-tensor all-gather.

    Bug (torch 2.11 to 2.14, gloo): ``_c10d_functional.all_gather_into_tensor`` (c10d routes it
    to ``allgather_into_tensor_coalesced``) corrupts the heap or hangs while another process group
    has work in flight (PaRO-CC's overlapped phases, prefetching). The op's CPU kernel becomes
    ``dist.all_gather_single(async_op=True)``, its work registered for ``wait_tensor`` (same op, same
    graphs). Idempotent; every ``MeshComm`` installs it. Test: tests/test_gloo_concurrency.py."""
    global _GLOO_LIB
    if _GLOO_LIB is not None:
        return
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", _all_gather_cpu, "CPU")
    lib.impl("all_gather_into_tensor_out", _all_gather_out_cpu, "CPU")
    lib.impl("all_gather_into_tensor_coalesced", _all_gather_coalesced_cpu, "CPU")
    _GLOO_LIB = lib


# ---- 2. inductor: one graph cache per rank, the kernels' builds shared ---------------------
def isolate_compile_cache(rank: int) -> None:
    """Give this rank its own FX-graph and AOTAutograd cache folders (``paro-rank<r>`` inside
    each), leaving the compiled kernels (C++ / Triton builds, keyed by their source) in the shared
    inductor cache.

    Bug (torch 2.13, inductor FX-graph / AOTAutograd cache): a rank's graphs name its own process
    groups, and with the selective-checkpoint region around the traced gathers (traced.py) torch
    replayed one rank's cache entry on another ("Could not resolve the process group registered
    under the name 1"). A kernel's source names no group, so the ranks share its build, as under
    FSDP2 (a folder per rank for everything made each rank build every kernel). Where the caches
    lack the folder hooks, the whole cache folder is the rank's own. Call it before compiling;
    idempotent. Test: tests/test_compat.py."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.codecache import FxGraphCache

    caches = (FxGraphCache, AOTAutogradCache)
    if not all(isinstance(c.__dict__.get("_get_tmp_dir"), (staticmethod, classmethod)) for c in caches):
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        tag = f"paro-rank{rank}"
        if os.path.basename(cache_dir()) != tag:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), tag)
        return
    for cache in caches:
        found = cache.__dict__["_get_tmp_dir"]
        original = getattr(found, "_paro_original", found)
        cache._get_tmp_dir = _per_rank_folder(original, f"paro-rank{rank}")


def _per_rank_folder(original: Any, tag: str) -> Any:
    """``original`` (a cache's ``_get_tmp_dir``, static or class method) with ``tag`` appended."""
    fn = original.__func__
    if isinstance(original, staticmethod):
        wrapped: Any = staticmethod(lambda: os.path.join(fn(), tag))
    else:
        wrapped = classmethod(lambda cls: os.path.join(fn(cls), tag))
    wrapped._paro_original = original
    return wrapped


# ---- 3. inductor's overlap scheduler: our estimate for its roofline too -----------------------
_TORCH_ROOFLINE: Callable | None = None
#: What inductor's overlap scheduler prices compute nodes with: 2.13+ and 2.11 / 2.12 names.
ROOFLINE_NAMES = ("estimate_roofline_runtime_ms", "estimate_runtime_analytical")


def roofline_name() -> str:
    """Which of ``ROOFLINE_NAMES`` this torch's overlap scheduler calls."""
    import torch._inductor.fx_passes.overlap_scheduling as overlap

    return next(n for n in ROOFLINE_NAMES if hasattr(overlap, n))


def route_roofline_estimate(estimate: Callable | None) -> None:
    """Make inductor's overlap scheduler price compute with ``estimate`` (None: torch's own).

    Bug (torch 2.11 to 2.14): ``OverlapScheduler`` prices every mm node with its GPU roofline
    (2.13+: before ``custom_runtime_estimation``; 2.11: after it, for its log), which fails
    without a GPU (or triton). The workaround replaces the module's roofline function, which the
    scheduler looks up at call time. Test: tests/test_compat.py (a CPU matmul node)."""
    global _TORCH_ROOFLINE
    import torch._inductor.fx_passes.overlap_scheduling as overlap

    name = roofline_name()
    if _TORCH_ROOFLINE is None:
        _TORCH_ROOFLINE = getattr(overlap, name)
    setattr(overlap, name, _TORCH_ROOFLINE if estimate is None else estimate)


# ---- 4. dynamo 2.14: a G = N group's boundary inside a compiled backward ------------------------
#: Gap (torch 2.14.0 / 2.14.1): with the boundary in the graph (``set_is_last_backward(True)``
#: under torch.compile), dynamo fails to trace a G = N group's ``boundary.reduce_to_os`` inside the
#: backward ("generator already executing") and runs that frame eagerly: exact, not compiled.
#: Test: tests/test_compile.py (strict xfail on 2.14: it fails once torch fixes it).
G_N_BOUNDARY_GRAPH_FALLS_BACK: bool = (2, 14) <= torch_version()
