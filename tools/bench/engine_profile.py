"""``python -m tools.bench.vs_fsdp2 --profile``: where PaRO's time goes. The engine's own functions
are timed by wrapping them at runtime (nothing in the engine is modified), then one step of PaRO
and one of FSDP2 run under torch.profiler and their op tables are printed side by side.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Any

import torch.distributed as dist

from .workload import reduce_max


class SectionTimer:
    """Wall time of wrapped functions: inclusive, self (minus wrapped callees), calls, and the
    time spent blocked in ``Pending.wait`` attributed to the wrapped function that waited.
    Only the calling thread is timed (on CPU, autograd runs backward on that thread)."""

    OUTSIDE = "<caller outside the engine>"

    def __init__(self) -> None:
        self.labels: list[str] = []
        self.total: dict[str, float] = defaultdict(float)
        self.self_: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.wait_by_caller: dict[str, float] = defaultdict(float)
        self.enabled = False
        self._stack: list[list[Any]] = []  # [label, time in wrapped callees]
        self._undo: list[tuple[Any, str, Any]] = []

    def clear(self) -> None:
        for d in (self.total, self.self_, self.calls, self.wait_by_caller):
            d.clear()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn = owner.__dict__[name]
        is_static = isinstance(fn, staticmethod)
        raw = fn.__func__ if is_static else fn
        timer = self
        is_wait = label.endswith("Pending.wait")

        @functools.wraps(raw)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not timer.enabled:
                return raw(*args, **kwargs)
            timer._stack.append([label, 0.0])
            t0 = time.perf_counter()
            try:
                return raw(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                _, inner = timer._stack.pop()
                timer.total[label] += dt
                timer.self_[label] += dt - inner
                timer.calls[label] += 1
                parent = timer._stack[-1][0] if timer._stack else timer.OUTSIDE
                if timer._stack:
                    timer._stack[-1][1] += dt
                if is_wait:
                    timer.wait_by_caller[parent] += dt

        setattr(owner, name, staticmethod(wrapped) if is_static else wrapped)
        self._undo.append((owner, name, fn))
        self.labels.append(label)

    def restore(self) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()


def instrument_paro(timer: SectionTimer) -> None:
    """Wrap every method the engine's hot-path classes define (found by introspection, so the
    profile follows the engine as it is edited; constructors and accounting are skipped)."""
    import inspect

    from paro_fsdp import comm, layout, param_group, state

    # the optimizer is torch's (over model.parameters()); the engine's refresh of the working
    # copies after its step is ParoState.refresh_params
    classes = [param_group.ParoParamGroup, state.ParoBlock, state.ParoState, layout.FlatLayout,
               comm.MeshComm, comm.Pending]
    skip = {"memory_bytes", "_count", "install_hooks", "state_dict", "load_state_dict", "_ensure_state",
            "_dtensor", "numel", "local_view"}
    for owner in classes:
        for name, fn in list(vars(owner).items()):
            if name.startswith("__") or name in skip:
                continue
            if inspect.isfunction(fn) or isinstance(fn, staticmethod):
                timer.wrap(owner, name, f"{owner.__module__.split('.')[-1]}.{owner.__name__}.{name}")


def profile_runners(cfg: Any, pairs: list, steps: int) -> None:
    """Section times of the PaRO engine, and a per-op profile of PaRO vs FSDP2, for each pair."""
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank()
    timer = SectionTimer()
    instrument_paro(timer)
    for pair in pairs:
        # 1) engine sections (wrapped functions), PaRO only
        timer.clear()
        timer.enabled = True
        wall = 0.0
        for _ in range(steps):
            wall += pair.paro.step()
        timer.enabled = False
        labels = sorted(timer.labels)  # the same list on every rank, whatever ran
        callers = labels + [timer.OUTSIDE]
        per_step = [timer.total[k] / steps for k in labels] + [timer.self_[k] / steps for k in labels]
        per_step += [timer.wait_by_caller[k] / steps for k in callers] + [wall / steps]
        maxed = reduce_max(per_step)
        n = len(labels)
        incl, self_ms, waits = maxed[:n], maxed[n:2 * n], maxed[2 * n:2 * n + len(callers)]
        calls = {k: timer.calls[k] / steps for k in labels}
        # 2) op profile of one step each, PaRO and FSDP2 (rank 0's view)
        tables = {}
        for runner in (pair.paro, pair.fsdp):
            runner.step()  # settle after instrumentation
            with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
                runner.step()
            tables[runner.label] = prof.key_averages()
        if rank != 0:
            continue
        print(f"\n===== profile: {pair.config}, A={pair.accum}: PaRO step {maxed[-1] * 1e3:.1f} ms "
              f"(instrumented; per step, max over ranks)")
        print(f"{'engine function':<52} {'incl ms':>8} {'self ms':>8} {'calls':>6}")
        for k, v, sv in sorted(zip(labels, incl, self_ms), key=lambda kv: -kv[1]):
            if v * 1e3 >= 0.05:
                print(f"  {k:<50} {v * 1e3:>8.2f} {sv * 1e3:>8.2f} {calls[k]:>6.0f}")
        print(f"{'blocked in Pending.wait, by the function that waited':<52} {'ms':>8}")
        for k, w in sorted(zip(callers, waits), key=lambda kv: -kv[1]):
            if w * 1e3 >= 0.05:
                print(f"  {k:<50} {w * 1e3:>8.2f}")
        print(f"\n{'op (self CPU ms, one step, rank 0)':<44} {'PaRO':>9} {'#':>5} {'FSDP2':>9} {'#':>5}")
        stats = {label: {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in t} for label, t in tables.items()}
        keys_op = set(stats["paro"]) | set(stats["fsdp2"])
        top = sorted(keys_op, key=lambda k: -max(stats["paro"].get(k, (0, 0))[0], stats["fsdp2"].get(k, (0, 0))[0]))[
            :22
        ]
        for k in top:
            p, f = stats["paro"].get(k, (0.0, 0)), stats["fsdp2"].get(k, (0.0, 0))
            print(f"  {k[:42]:<42} {p[0]:>9.2f} {p[1]:>5} {f[0]:>9.2f} {f[1]:>5}")
        tot_p = sum(v[0] for v in stats["paro"].values())
        tot_f = sum(v[0] for v in stats["fsdp2"].values())
        print(f"  {'sum of self CPU (FSDP:: scopes hold waits)':<42} {tot_p:>9.2f} {'':>5} {tot_f:>9.2f}")
    timer.restore()
