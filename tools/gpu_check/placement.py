"""Part (b): real device tensors on torch's fake process group (a 2 x 4 mesh in one process).
Every strategy shards a small Llama and trains a step, and every buffer the engine and the
optimizer hold must be on the device; then the memory cases of ``memory.py``.
"""
from __future__ import annotations

import time
from typing import Any

from .checks import FAIL, MEMORY_TOL, PASS, check
from .memory import init_fn, llama_args, memory_case, unsharded_working_set
from .plan import B_MEMORY, B_MEMORY_STRATEGIES, B_SMALL
from .report import Emitter, fmt_bytes


def fake_world(world: int = 8) -> None:
    """Make this process rank 0 of torch's fake process group of ``world`` ranks (reusing one of
    that size; a fake group of another size is replaced; a real one is an error)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(f"needs a process without a real process group (found {dist.get_backend()!r})")
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def fake_mesh(device: str, shape: tuple[int, int] = (2, 4)):
    """A ("inter", "intra") mesh of ``shape`` on the fake process group, on ``device``."""
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(shape[0] * shape[1])
    return init_device_mesh(device, shape, mesh_dim_names=("inter", "intra"))


# the engine internals the brief names: each must be found where the strategy has it
def _required_internals(group: Any) -> list[str]:
    from paro_fsdp.strategy import Level

    strategy = group.strategy
    need = ["p_locals", "master", "grad_acc"]
    if strategy.p != Level.N:  # P = OS in bf16: the masters are the P storage (``casts_p``)
        need += ["full_bufs"] if group.casts_p else ["p_flat", "full_bufs"]
    if strategy.os != Level.N:
        need += ["master_flat"]
    return need


def _tensors_of(value: Any) -> list[tuple[str, Any]]:
    import torch

    from paro_fsdp.param_group import GradAccumulator

    if isinstance(value, GradAccumulator):  # the group's G accumulator: its tensor, once allocated
        value = value.tensor
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def _group_attrs(group: Any) -> dict[str, Any]:
    """A group's attributes and the views its class exposes as properties (``p_locals``,
    ``master``, ``full_bufs``, ... over its ``ParoParam``s); a view that cannot be read now is
    left out."""
    attrs = dict(vars(group))
    for klass in type(group).__mro__:
        for name, value in vars(klass).items():
            if isinstance(value, property) and name not in attrs:
                try:
                    attrs[name] = getattr(group, name)
                except Exception:  # noqa: BLE001 - a view valid only in some state
                    continue
    return attrs


def buffer_devices(model: Any, opt: Any, device_type: str) -> dict[str, Any]:
    """Every tensor the sharded model, its engine groups and its optimizer (a torch optimizer
    over ``model.parameters()``) hold, with the ones not on ``device_type`` (DTensors are looked
    at through their local tensor)."""
    from torch.distributed.tensor import DTensor

    wrong: list[str] = []
    seen: dict[str, int] = {}
    visited: set[int] = set()
    count = 0

    def visit(label: str, kind: str, t: Any) -> None:
        nonlocal count
        visited.add(id(t))
        if isinstance(t, DTensor):
            t = t._local_tensor
        count += 1
        seen[kind] = seen.get(kind, 0) + 1
        if t.device.type != device_type:
            wrong.append(f"{label} on {t.device}")

    for name, p in model.named_parameters():
        visit(f"parameter {name}", "parameters", p)
    for name, b in model.named_buffers():
        visit(f"buffer {name}", "buffers", b)
    missing = []
    for g in model._paro_state.groups:
        attrs = _group_attrs(g)
        for attr, value in attrs.items():
            for suffix, t in _tensors_of(value):
                visit(f"{g.name}.{attr}{suffix}", attr, t)
        # per tensor (param.ParoParam): whatever the views above did not reach
        for i, pp in enumerate(getattr(g, "params", None) or []):
            for attr, value in (vars(pp).items() if hasattr(pp, "__dict__") else ()):
                for suffix, t in _tensors_of(value):
                    if id(t) not in visited:
                        visit(f"{g.name}.params[{i}].{attr}{suffix}", f"params.{attr}", t)
        for attr in _required_internals(g):
            if attr == "grad_acc" and not g.trainable:
                continue
            value = attrs.get(attr)
            if value is None or getattr(value, "tensor", value) is None:  # GradAccumulator: not allocated
                missing.append(f"{g.name}.{attr}")
        # the fp32 master gradients: the trainable parameters' .grad (the masters are their local tensors)
        for i, p in enumerate(g.sharded_params[: len(g.trainable)]):
            if p.grad is not None:
                visit(f"{g.name}.sharded_params[{i}].grad", "master.grad", p.grad)
    for i, state in enumerate(opt.state.values()):
        for k, v in state.items():
            if hasattr(v, "device"):
                visit(f"optimizer state {i}.{k}", f"optimizer.{k}", v)
    return {"count": count, "wrong": wrong, "missing": missing, "kinds": seen}


def placement_case(mesh: Any, device: str, strategy: str, args: Any = None) -> dict[str, Any]:
    """Shard a small Llama built on the meta device with ``strategy`` on ``mesh``, train one step
    of two micro-steps (the first with ``set_requires_gradient_sync(False)``: its gradients stay in
    the G-level accumulator; the second reduces them to the parameters' ``.grad``), clip, step (the
    trainer's fused AdamW over ``model.parameters()``, torch's ``clip_grad_norm_``), and look at
    every buffer's device after each backward, after clipping and after the step. The engine's
    internals must all be there after the first backward, and after the step all but the
    accumulator (which the boundary may free)."""
    import torch

    from paro_fsdp import MixedPrecision, paro_shard
    from paro_fsdp.models.llama import Llama

    args = args or llama_args(**B_SMALL)
    with torch.device("meta"):
        model = Llama(args)
    model = paro_shard(model, mesh, strategy, mp=MixedPrecision(torch.bfloat16, torch.float32),
                       param_init_fn=init_fn(0, args.n_layers))
    model.init_buffers(torch.device(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)).to(device)
    wrong, counts, missing, kinds = [], [], set(), {}

    def micro_step(sync: bool) -> None:
        model.set_requires_gradient_sync(sync)
        out = model(tokens)
        if out.logits.device.type != device:
            wrong.append(f"logits on {out.logits.device}")
        (out.loss / 2).backward()

    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
    for when, fn in (("after an unsynced backward", lambda: micro_step(False)),
                     ("after the last backward", lambda: micro_step(True)), ("after clip", clip),
                     ("after step", opt.step)):
        fn()
        seen = buffer_devices(model, opt, device)
        wrong += [f"{w} ({when})" for w in seen["wrong"]]
        if when == "after an unsynced backward":
            missing |= set(seen["missing"])
        elif when == "after step":
            missing |= {m for m in seen["missing"] if not m.endswith(".grad_acc")}
        counts.append(seen["count"])
        for kind, n in seen["kinds"].items():
            kinds[kind] = max(kinds.get(kind, 0), n)
    opt.zero_grad()
    return {"strategy": strategy, "tensors_checked": sum(counts), "wrong": wrong, "missing": sorted(missing),
            "kinds": kinds}


def worker_b(emit: Emitter, device: str) -> None:
    import torch

    from paro_fsdp.strategy import ALL_STRATEGIES

    mesh = fake_mesh(device)
    names = [str(s) for s in ALL_STRATEGIES]
    t0 = time.monotonic()
    cases, errors = [], {}
    for s in names:
        try:
            cases.append(placement_case(mesh, device, s))
        except Exception as exc:  # noqa: BLE001 - one strategy's failure must not hide the others
            errors[s] = f"{type(exc).__name__}: {exc}"[:300]
    bad = {c["strategy"]: c["wrong"][:5] + [f"missing {m}" for m in c["missing"]]
           for c in cases if c["wrong"] or c["missing"]}
    n = sum(c["tensors_checked"] for c in cases)
    ok = not bad and not errors and len(cases) == len(names)
    text = (f"{len(cases) - len(bad)}/{len(names)} strategies: {n} tensors on {device}, {time.monotonic() - t0:.0f} s"
            + (f"; wrong: {bad}" if bad else "") + (f"; errors: {errors}" if errors else ""))
    emit(check("b", "b.placement", f"27 strategies: every buffer on {device}", PASS if ok else FAIL, text,
               "every tensor", cases=cases, errors=errors))

    kw, batch, seq = B_MEMORY[device]
    args = llama_args(**kw)
    ws = unsharded_working_set(args, batch, seq, device, torch.bfloat16)
    for s in B_MEMORY_STRATEGIES:
        name = f"memory {s}, {'7B-shaped' if device == 'cuda' else 'small'} 2-layer slice"
        try:
            r = memory_case(mesh, device, s, args, batch, seq, ws["working_set"])
        except Exception as exc:  # noqa: BLE001
            emit(check("b", f"b.mem.{s}", name, FAIL, f"{type(exc).__name__}: {exc}"[:300]))
            continue
        text = (f"peak {fmt_bytes(r['peak'])} = {r['ratio']:.3f} x expected {fmt_bytes(r['expected'])} (states "
                f"{fmt_bytes(r['states'])} + {'working set' if r['working_set'] >= r['boundary'] else 'boundary'} "
                f"{fmt_bytes(max(r['working_set'], r['boundary']))}); resident {fmt_bytes(r['resident'])}"
                + (f"; max reserved {fmt_bytes(r['reserved'])}" if r.get("reserved") else ""))
        emit(check("b", f"b.mem.{s}", name, PASS if r["ok"] else FAIL, text, f"within {MEMORY_TOL:.0%}",
                   unsharded=ws, **r))
