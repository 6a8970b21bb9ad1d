"""``ParoOptimizer``: any torch.optim optimizer over the fp32 master shards at the OS level."""
from __future__ import annotations

import math
from typing import Any, Type

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .boundary import drive, finalize_grads, push_params, run
from .overlap import forward_dims, push_bytes, push_dims
from .param_group import ParoParamGroup
from .strategy import Level


class ParoOptimizer:
    """The accumulation boundary around an inner optimizer: ``clip_grad_norm_`` and ``step`` first
    reduce the accumulated gradients to the OS level, the inner optimizer updates the master
    shards, and the updated values move to the P level."""

    def __init__(self, model: nn.Module, optimizer_class: Type[torch.optim.Optimizer], **kwargs: Any) -> None:
        if not hasattr(model, "_paro_state"):
            raise ValueError("ParoOptimizer needs a model returned by paro_shard(model, mesh, policy)")
        self.model = model
        self.state = model._paro_state
        self.groups = [g for g in self.state.groups if g.trainable]
        self.fqn_of: dict[nn.Parameter, str] = {}
        masters = []
        for g in self.groups:
            for ref, master in zip(g.trainable, g.master):
                self.fqn_of[master] = ref.fqn
                masters.append(master)
        if not masters:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
        self.inner = optimizer_class(masters, **kwargs)
        self._push = _push_eager

    def compile(self, **kwargs: Any) -> None:
        """Run the push of the updated parameters to the P level as one compiled graph (``kwargs``
        go to ``torch.compile``), whose collectives the passes merge and schedule; the inner
        optimizer's update stays as the user built it."""
        self._push = torch.compile(_push_traced, **kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def _finalize(self) -> None:
        if not any(g.has_grads for g in self.groups):
            raise RuntimeError(
                "ParoOptimizer: no gradients since the last step; call loss.backward() on the "
                "sharded model's output before clip_grad_norm_() / step()"
            )
        self.state.pushes.finish()
        self.state.finish_grad_reductions()
        self.state.boundary.finish()  # what the last backward left in flight
        drive([finalize_grads(g) for g in self.groups])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm over all ranks and return that norm."""
        self._finalize()
        info = self.state.info
        norm_type = float(norm_type)
        owned = []
        for g in self.groups:
            # count each element once: an OS shard replicated r times is counted on one replica
            if {Level.G: True, Level.I: info.k == 0, Level.N: info.k == 0 and info.l == 0}[g.strategy.os]:
                owned += [m.grad for m in g.master if m.numel()]
        local = torch.zeros((), dtype=torch.float32, device=self.groups[0].device)
        if owned:
            # torch's CPU float32 norm kernels accumulate in float32, so the norm would depend on
            # the sharding: float64 there (the CUDA kernels reduce in trees)
            wide = {"dtype": torch.float64} if owned[0].device.type == "cpu" and not math.isinf(norm_type) else {}
            norms = torch.stack(torch._foreach_norm(owned, norm_type, **wide))
            local = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum().float()
        op = "max" if math.isinf(norm_type) else "sum"
        total = self.state.comm.all_reduce(local, "global", op=op).wait()
        total = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([m.grad for g in self.groups for m in g.master], coef)
        return total

    @torch.no_grad()
    def step(self) -> None:
        self._finalize()
        self.inner.step()
        for g in self.state.groups:
            g.reshard()  # a gathered copy (root in eval, prefetch) would now be stale
        if self._push is _push_eager and self._can_defer_push():
            deferred = [g for g in self.groups if push_dims(g)]
            _push_eager([g for g in self.groups if not push_dims(g)])  # local copies
            for g in deferred:  # root first: the order the next forward needs them
                self.state.pushes.queue(g, push_params(g), push_bytes(g))
            self.state.pushes.fill()
        else:
            self._push(self.groups)

    def _can_defer_push(self) -> bool:
        """Whether the pushes may wait for the next forward (overlap.py): eager blocks only (a
        traced block reads P inside its graph), after a forward has shown the order, not while
        torch.profiler records (a collective it saw issued must not be waited after it stopped:
        gloo's wait crashed there), and no forward all-gather sharing a process group with a push."""
        state = self.state
        if not state.seen_forward or any(b.traced for b in state.blocks) or torch.autograd._profiler_enabled():
            return False
        gathers = set().union(*(forward_dims(g) for g in state.groups))
        return not any(push_dims(g) & gathers for g in self.groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.state.boundary.finish()  # a skipped step: what every rank issued still completes
        for g in self.state.groups:
            g.zero_grad()

    # ---- checkpointing: DTensors keyed by parameter name, loadable by DCP under any mesh ----
    def _ensure_state(self) -> None:
        """Create optimizer states before a load (as DCP's helpers do): a zero-lr step on zero grads."""
        if self.inner.state:
            return
        saved = [dict(pg) for pg in self.inner.param_groups]
        for pg in self.inner.param_groups:
            pg["lr"] = 0.0
            for p in pg["params"]:
                p.grad = torch.zeros_like(p)
        self.inner.step()
        for pg, old in zip(self.inner.param_groups, saved):
            pg["lr"] = old["lr"]
            for p in pg["params"]:
                p.grad = None

    def state_dict(self) -> dict[str, Any]:
        self._ensure_state()
        master, state = {}, {}
        for g in self.groups:
            for t, m in zip(g.t_layout.tensors, g.master):
                fqn = self.fqn_of[m]
                master[fqn] = g.os_dtensor(t, m.detach())
                state[fqn] = {k: (g.os_dtensor(t, v) if torch.is_tensor(v) and v.shape == m.shape and v.dim() else v)
                              for k, v in self.inner.state[m].items()}
        groups = []
        for pg in self.inner.param_groups:
            entry = {k: v for k, v in pg.items() if k != "params"}
            entry["params"] = [self.fqn_of[p] for p in pg["params"]]
            groups.append(entry)
        return {"master": master, "state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._ensure_state()
        by_fqn = {fqn: m for m, fqn in self.fqn_of.items()}
        for fqn, value in sd["master"].items():
            by_fqn[fqn].copy_(value.to_local() if isinstance(value, DTensor) else value)
        for fqn, entries in sd["state"].items():
            target = self.inner.state[by_fqn[fqn]]
            for k, v in entries.items():
                v = v.to_local() if isinstance(v, DTensor) else v
                if torch.is_tensor(target.get(k)):
                    target[k].copy_(v)
                else:
                    target[k] = v
        for pg, saved in zip(self.inner.param_groups, sd["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    pg[k] = v
        self.state.pushes.finish()
        for g in self.state.groups:
            g.reshard()
        self._push(self.groups)


def _push_eager(groups: list[ParoParamGroup]) -> None:
    """Every group's push side by side (their collectives in flight together)."""
    drive([push_params(g) for g in groups])


def _push_traced(groups: list[ParoParamGroup]) -> None:
    """What ``ParoOptimizer.compile`` compiles: each group's push in turn, every collective
    waited as issued (in the graph, the passes decide what overlaps)."""
    for g in groups:
        run(push_params(g))
