"""Memory of part (b), and what (b) and (c) share: Llama shapes, a seeded per-parameter init that
is the same on any device and for PaRO and FSDP2, ``MemoryMeter`` (allocated bytes per phase),
the measured working set of an unsharded step, and one strategy's peak against its
``memory_report``.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from .checks import expected_peak, memory_within


def llama_args(**kw: Any):
    from paro_fsdp.models.llama import LlamaArgs

    return LlamaArgs(**kw)


def init_fn(seed: int = 0, n_layers: int = 2) -> Callable[[str, Any], None]:
    """Fill a whole parameter on its own device from (seed, name): fast on a GPU (no host RNG) and
    the same for PaRO and FSDP2, so both start from the same weights."""
    import zlib

    import torch

    def init(name: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            if t.dim() == 1:
                t.fill_(1.0)
                return
            std = 0.02 / (math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0)
            gen = torch.Generator(device=t.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            t.normal_(0.0, std, generator=gen)
    return init


class MemoryMeter:
    """Allocated bytes per phase, relative to the start of a session: on CUDA the caching
    allocator's counters (``memory_allocated``, ``max_memory_allocated`` reset per phase, and the
    peak of ``max_memory_reserved``, absolute: what the allocator held from the driver); on CPU
    (only to exercise the code here) torch.profiler's allocation events, replayed in time order."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.phases: dict[str, dict[str, float]] = {}
        self._base = 0
        self._prof = None
        self._marks: list[tuple[str, Any]] = []

    def __enter__(self) -> "MemoryMeter":
        import gc

        import torch

        gc.collect()  # an earlier case's model freed by a later GC inside this session would count against it
        if self.device == "cuda":
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self._replay()

    def phase(self, name: str):
        import contextlib

        import torch

        meter = self

        @contextlib.contextmanager
        def cm():
            if meter.device == "cuda":
                torch.cuda.synchronize()
                start = torch.cuda.memory_allocated() - meter._base
                torch.cuda.reset_peak_memory_stats()
                yield
                torch.cuda.synchronize()
                meter.phases[name] = {
                    "start": start,
                    "peak": torch.cuda.max_memory_allocated() - meter._base,
                    "end": torch.cuda.memory_allocated() - meter._base,
                    "reserved": float(torch.cuda.max_memory_reserved()),
                }  # absolute, the allocator's pool
            else:
                with torch.profiler.record_function(f"gpu_check::{name}"):
                    yield
        return cm()

    def _replay(self) -> None:
        from torch._C._profiler import _EventType

        allocs: list[tuple[int, int]] = []
        ranges: dict[str, tuple[int, int]] = {}
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation:
                if str(node.extra_fields.device).startswith("cpu"):
                    allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
            elif node.name.startswith("gpu_check::"):
                ranges[node.name.split("::", 1)[1]] = (node.start_time_ns, node.end_time_ns)
            stack.extend(node.children)
        allocs.sort()
        for name, (t0, t1) in ranges.items():
            cur, start, peak = 0, None, None
            for t, size in allocs:
                if t > t1:
                    break
                if t >= t0 and start is None:
                    start = peak = cur
                cur += size
                if t >= t0:
                    peak = max(peak, cur)
            if start is None:
                start = peak = cur
            self.phases[name] = {"start": float(start), "peak": float(peak), "end": float(cur)}


def unsharded_working_set(args: Any, batch: int, seq: int, device: str, dtype: Any) -> dict[str, float]:
    """The working set of one training micro-step, measured: the peak of an unsharded
    single-device forward/backward of the same model and batch, above the memory in use before
    the model existed. Parameters in ``dtype``, whole, as the sharded model gathers them (with
    prefetch, a 2-layer slice has all of its blocks gathered at once); each gradient is freed as
    soon as it is produced, since the engine reduces block gradients at once and its accumulator
    is counted in the model states."""
    import torch

    from paro_fsdp.models.llama import Llama

    with torch.device("meta"):
        model = Llama(args)
    model = model.to(dtype)
    init = init_fn(0, args.n_layers)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    with MemoryMeter(device) as meter:
        with meter.phase("build"):
            model.to_empty(device=device)
            for name, p in model.named_parameters():
                init(name, p.data)
            model.init_buffers(torch.device(device))
            x = tokens.to(device)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        with meter.phase("fwd_bwd"):
            model(x).loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = meter.phases["fwd_bwd"]["peak"]
    del model, x
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"working_set": peak, "param_bytes": float(params), "activations_and_temporaries": peak - params}


def memory_case(
    mesh: Any, device: str, strategy: str, args: Any, batch: int, seq: int, working_set: float
) -> dict[str, Any]:
    """Peak allocated bytes of the second training step of ``strategy`` (bf16 P and G, fused
    AdamW over ``model.parameters()``, torch's ``clip_grad_norm_``) against ``expected_peak`` of
    its ``memory_report``."""
    import torch

    from paro_fsdp import MixedPrecision, paro_shard
    from paro_fsdp.models.llama import Llama

    tokens = [
        torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(i))
        for i in range(2)
    ]
    with MemoryMeter(device) as meter:
        with meter.phase("build"):
            with torch.device("meta"):
                model = Llama(args)
            model = paro_shard(model, mesh, strategy, mp=MixedPrecision(torch.bfloat16, torch.bfloat16),
                               param_init_fn=init_fn(0, args.n_layers))
            model.init_buffers(torch.device(device))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

        def step(x: torch.Tensor) -> None:
            model(x.to(device)).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        with meter.phase("step1"):
            step(tokens[0])
        # the G accumulators still allocated between steps (the engine frees each once its sum
        # reached the parameters' .grad): memory_report's G counts them whole
        g_held = sum(t.numel() * t.element_size() for g in model._paro_state.groups
                     if (t := g.grad_acc.tensor) is not None)
        with meter.phase("step2"):
            step(tokens[1])
        report = {k: int(v) for k, v in model.memory_report(opt).items()}
    ph = meter.phases
    exp = expected_peak(report, working_set)
    within = memory_within(ph["step2"]["peak"], exp["expected"])
    model = opt = None  # freed before empty_cache (the closure above holds them too)
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "strategy": strategy,
        "report": report,
        "resident": ph["step2"]["start"],
        "peak": ph["step2"]["peak"],
        "peak_step1": ph["step1"]["peak"],
        "build_peak": ph["build"]["peak"],
        "reserved": ph["step2"].get("reserved"),
        "g_held": float(g_held),
        "resident_states": float(report["P"] + report["OS"] + g_held),
        **exp,
        **within,
    }
