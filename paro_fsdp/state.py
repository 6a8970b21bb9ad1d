"""Per-block and per-model engine state, and the module hooks, registered in one place (the
micro-step's flow through them: docs/ARCHITECTURE.md, "One optimizer step")."""
from __future__ import annotations

import enum
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from .comm import MeshComm
from .hooks import Unshard, in_backward, register_post_backward, register_pre_backward
from .boundary import drive, finalize_grads, push_params, run_grad_hooks
from .collectives import USED
from .mesh import MeshInfo
from .optimizer_hooks import unwatch as unwatch, watch as watch
from .overlap import InFlight, boundary_bytes, forward_dims, has_boundary_traffic, push_bytes, push_dims
from .param_group import GradState, ParoParamGroup, ShardState
from .paro_cc import ParoCC
from .streams import active
from .traced import unshard as traced_unshard


class TrainingState(enum.Enum):
    """Where the model is between steps (FSDP2 keeps one per module; the root's is enough here)."""
    NEW = 0  # no forward yet: the blocks' order is unknown, so pushes are not deferred to it
    IDLE = 1  # between calls: a forward has shown the order
    BACKWARD = 2  # a backward is running: the end-of-backward callback is queued


class ParoBlock:
    """One module whose parameters move together (or a list of modules given to one
    ``fully_shard`` call, FSDP2's group): one collective per group and phase."""

    def __init__(self, name: str, modules: list[nn.Module], groups: list[ParoParamGroup], model_state: "ParoState",
                 reshard_after_forward: bool | None = True) -> None:
        self.name, self.modules, self.groups, self.model_state = name, modules, groups, model_state
        self.is_root = False
        # as asked (FSDP2's): None reshards a block after forward but keeps the root unsharded
        self.reshard_after_forward = reshard_after_forward
        self.unshard_in_backward = True  # FSDP2's set_unshard_in_backward
        self.cast_inputs: torch.dtype | None = None  # floating inputs cast at its forward (paro_shard: root only)
        self.cast_output: torch.dtype | None = None  # floating outputs cast after its forward (FSDP2's output_dtype)
        self.traced = False  # set once torch.compile has traced this block: no eager prefetch into it
        # FSDP2's set_modules_to_forward/backward_prefetch (None: the next block in the recorded order)
        self.forward_prefetch: list[ParoBlock] | None = None
        self.backward_prefetch: list[ParoBlock] | None = None
        self.to_run: set[int] = set()  # a group of modules: those whose forward has not run yet in this pass

    @property
    def module(self) -> nn.Module:
        return self.modules[0]

    @property
    def keeps_registered(self) -> bool:
        """The whole tensors stay registered after forward (FSDP2's ``reshard_after_forward=False``, the
        root's default): calls into inner modules after it (``generate``) then meet them."""
        return self.reshard_after_forward is False or (self.reshard_after_forward is None and self.is_root)

    def gather(self, prefetch_next: bool = True, backward: bool = False) -> None:
        for g in self.groups:
            g.unshard()
        if prefetch_next:
            explicit = self.backward_prefetch if backward else self.forward_prefetch
            if explicit is None:
                nxt = self.model_state.next_block(self, backward)
                explicit = [nxt] if nxt is not None else []
            for nxt in explicit:
                if nxt.traced:
                    continue
                for g in nxt.groups:
                    if g.p_flat is not None:
                        self.model_state.land_push(g)
                    g.issue_unshard()

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any):
        if self.cast_inputs is not None:  # at every sharded module's forward, as FSDP2 casts (recomputations too)
            args, kwargs = _cast_floating((args, kwargs), self.cast_inputs)
        if len(self.modules) > 1 and not in_backward() and not torch.compiler.is_compiling():
            if self.to_run:  # a later module of the group: its parameters are in place already
                return args, kwargs
            self.to_run = {id(m) for m in self.modules}
        # inside backward, activation checkpointing recomputes the block: the same autograd Functions,
        # so it saves what the forward saved, but neither the order recorded nor a prefetch
        if torch.compiler.is_compiling():  # the traced path: see traced.py
            self.traced = True
            for g in self.groups:
                g.register(traced_unshard(g))
            return args, kwargs
        state = self.model_state
        if self.is_root and not in_backward():
            state.check_params()
            state.refresh_params()
            state.pushes.fill()  # the step's pushes go on the wire with the forward that reads them
        for g in self.groups:
            state.land_push(g)
        if in_backward():
            for g in self.groups:
                g.unshard()
        else:
            if self.is_root:
                state.forward_order = []
            else:
                state.forward_order.append(self)
            if state.training_state is TrainingState.NEW:
                state.training_state = TrainingState.IDLE
            if self.is_root and (streams := active(state.comm.streams)) is not None:
                streams.params_written()  # the step's P writes are queued: later gathers start after them
                if state.post_optim_event is not None:  # FSDP2's set_post_optim_event: one more ordering
                    streams.gather.wait_event(state.post_optim_event)
            if self.is_root:
                state.post_optim_event = None
            self.gather()
        grad_enabled = torch.is_grad_enabled()
        for i, g in enumerate(self.groups):
            g.register(Unshard.apply(g.full_params, partial(self.post_backward, i), *g.sharded_params)
                       if grad_enabled else g.full_params)
            if grad_enabled and not in_backward():
                g.uses_left += 1
        if grad_enabled and any(not g.trainable for g in self.groups):
            args, kwargs = register_post_backward(self.post_backward_frozen, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any):
        output = self._post_forward(module, output)
        # after each module of the group, past the pre-backward hooks, as FSDP2's
        return output if self.cast_output is None else _cast_floating(output, self.cast_output)

    def _post_forward(self, module: nn.Module, output: Any):
        if torch.compiler.is_compiling():
            for g in self.groups:
                g.register(g.sharded_params)
            return output
        if torch.is_grad_enabled():
            output = register_pre_backward(self.pre_backward, output)
        if len(self.modules) > 1 and not in_backward():
            self.to_run.discard(id(module))
            if self.to_run:  # the group's other modules have yet to run
                return output
        if self.is_root and not in_backward():
            for b in self.model_state.blocks:
                if b.to_run:  # a group some of whose modules never ran (FSDP2 completes them here)
                    b.to_run = set()
                    b.finish_forward()
        if not in_backward():  # a recomputation keeps the whole tensors until the block's backward ends
            self.finish_forward()
        return output

    def finish_forward(self) -> None:
        """The sharded parameters back unless ``keeps_registered``; the gathered tensors freed as
        resharding asks (the root's stay for its backward)."""
        keep = self.keeps_registered
        for g in self.groups:
            if not keep:
                g.register_sharded()
            if (g.reshard_after_forward and not self.is_root) or (not torch.is_grad_enabled() and not keep):
                g.reshard()

    def pre_backward(self) -> None:
        if self.is_root:
            self.model_state.begin_backward()
        if not self.unshard_in_backward:  # the user's word that backward reads none of its parameters
            return
        self.gather(backward=True)
        # registered through backward, as FSDP2's: a recomputation the hooks do not see (transformers'
        # checkpointing wraps ``forward``) reads them from the modules; reentrant, it reaches this Unshard
        with torch.enable_grad():
            for i, g in enumerate(self.groups):
                g.register(Unshard.apply(g.full_params, partial(self.post_backward, i), *g.sharded_params))

    def release(self, group: ParoParamGroup) -> None:
        """After the group's backward: the whole tensors freed, or kept registered under
        ``set_reshard_after_backward(False)``, as FSDP2's."""
        self.to_run = set()
        if group.reshard_after_backward:
            group.reshard()
        else:
            group.register(group.full_params if group.state is ShardState.UNSHARDED else group.sharded_params)

    def post_backward_frozen(self) -> None:
        for g in self.groups:
            if not g.trainable:
                self.release(g)

    def post_backward(self, group_index: int, grads: list[torch.Tensor | None]) -> None:
        g = self.groups[group_index]
        state = self.model_state
        state.queue_end_backward()  # the root's pre-backward may not have run: an output torch's pytree cannot see into
        state.progress_grad_reductions(self)
        g.uses_left = max(g.uses_left - 1, 0)
        if g.trainable:
            g.reduce_grads(grads[: len(g.trainable)])
            if g.last_backward and not len(state.boundary) and has_boundary_traffic(g) and not g.uses_left:
                state._finish_reduction(g)  # the first boundary collective of the step goes out now
            elif (self, g) not in state.in_flight:
                state.in_flight.append((self, g))
        self.release(g)


def _inside_checkpoint(module: nn.Module) -> nn.Module:
    """Inside torch's ``checkpoint_wrapper`` (applied before sharding), so the recomputation in
    backward runs the hooks again and meets gathered parameters."""
    while hasattr(module, "_checkpoint_wrapped_module"):
        module = module._checkpoint_wrapped_module
    return module


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors of ``tree`` as ``dtype`` (FSDP2's ``cast_forward_inputs``); the
    rest (token ids, masks, caches) untouched."""
    return tree_map(lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype else x,
                    tree)


class ParoState:
    """The model-wide view: blocks in execution order, the ledger, the end-of-backward work."""

    def __init__(self, info: MeshInfo, comm: MeshComm, cc: ParoCC, blocks: list[ParoBlock]) -> None:
        self.info, self.comm, self.cc, self.blocks = info, comm, cc, blocks
        self.forward_order: list[ParoBlock] = []
        self.training_state = TrainingState.NEW
        self.in_flight: list[tuple[ParoBlock, ParoParamGroup]] = []  # gradient reductions to the G level
        self.boundary = InFlight()  # last micro-step: reductions to the OS level (overlap.py)
        self.pushes = InFlight()  # after the step: master -> P level, waited at each pre-forward
        self.compiled_push = None  # traced._compile_push: the pushes as one compiled graph
        self.applying = False  # inside ParoModule._apply (module.to(...)): nested sharded modules leave it alone
        self.post_optim_event: torch.Event | None = None  # FSDP2's set_post_optim_event, for the next forward
        self.refresh_after_backward = False  # an optimizer stepped inside backward: push at its end
        self.flags_group = None  # on a GPU mesh: the CPU group used_grads asks the other ranks through

    @property
    def groups(self) -> list[ParoParamGroup]:
        return [g for b in self.blocks for g in b.groups]

    @property
    def running_backward(self) -> bool:
        return self.training_state is TrainingState.BACKWARD

    def begin_backward(self) -> None:
        self.pushes.finish()  # groups the forward did not reach
        self.queue_end_backward()

    def queue_end_backward(self) -> None:
        if self.training_state is not TrainingState.BACKWARD:
            self.training_state = TrainingState.BACKWARD
            Variable._execution_engine.queue_callback(self.end_backward)

    def next_block(self, block: ParoBlock, backward: bool) -> ParoBlock | None:
        """The block expected to run next: registration order forward, the reverse of the
        recorded forward order in backward."""
        order = self.forward_order[::-1] if backward else [b for b in self.blocks if not b.is_root]
        if block.is_root:
            return order[0] if order else None
        if block in order:
            i = order.index(block)
            return order[i + 1] if i + 1 < len(order) else None
        return None

    def progress_grad_reductions(self, block: ParoBlock) -> None:
        """The previous block's reductions advance a phase, older ones finish: two blocks of slack,
        as FSDP2's (one ahead of boundary traffic); a block's own groups never wait for each other."""
        earlier = [b for b, _ in self.in_flight if b is not block]
        prev = earlier[-1] if earlier else None
        keep = []
        for b, g in self.in_flight:
            # on the last micro-step a reduction with boundary traffic after it finishes a block
            # sooner: its slow collective then starts while more of backward is left to hide it
            if b is block or (b is prev and not (g.last_backward and has_boundary_traffic(g))):
                keep.append((b, g))
            else:
                self._finish_reduction(g)
        self.in_flight = keep
        for b, g in keep:
            if b is prev:
                g.advance_grad_reduction()
        self.boundary.advance()

    def _finish_reduction(self, g: ParoParamGroup) -> None:
        g.finish_grad_reduction()
        if g.last_backward and not g.uses_left and not torch.compiler.is_compiling():  # the step boundary starts now
            self.boundary.queue(g, finalize_grads(g), boundary_bytes(g))
            self.boundary.fill(finish_oldest=True)

    def land_push(self, group: ParoParamGroup) -> None:
        """Finish ``group``'s push (and those queued before it): it writes P on the current
        stream, which the next parameter gathers must follow (streams.py)."""
        if self.pushes.finish(group) and (streams := active(self.comm.streams)) is not None:
            streams.params_written()

    def end_backward(self) -> None:
        """As FSDP2's root post-backward: every reduction lands, so after ``backward()`` each
        parameter whose group reduced holds its gradient in ``.grad``."""
        self.training_state = TrainingState.IDLE
        for g in self.groups:
            g.uses_left = 0  # uses whose backward never ran (a forward without backward) wait no longer
        for _, g in self.in_flight:
            self._finish_reduction(g)
        self.in_flight.clear()
        self.boundary.finish()  # the boundary's reductions started under backward (overlap.py)
        drive([finalize_grads(g) for g in self.groups if g.last_backward and g.grads is GradState.AT_G])
        self.used_grads()
        if self.comm.pool is not None:
            self.comm.pool.clear()  # nothing held between micro-steps (comm.BufferPool)
        for b in self.blocks:
            for g in b.groups:
                b.release(g)
        if (streams := active(self.comm.streams)) is not None:
            streams.release()  # the kept gather results, once the gather stream has waited for their reads
        if self.refresh_after_backward:
            self.refresh_after_backward = False
            self.refresh_params()

    def used_grads(self) -> None:
        """FSDP2's ``.grad`` of a parameter no rank used in the step is None (torch's optimizers then skip
        it: no decay, no move by its moments), not zeros. One MAX all-reduce over all ranks of a byte per
        tensor of the groups that reached their boundary in this backward decides for the tensors this rank
        did not use; the used ones' hooks then run. Every rank's backward reached the same groups, so it
        is issued everywhere or nowhere (the traced path tracks nothing: its tensors count as used)."""
        groups = [g for g in self.groups if g.used_here is not None]
        if not groups:
            return
        anywhere = [u for g in groups for u in g.used_here]
        if self.info.n > 1:  # alone, this rank's own flags decide
            anywhere = self._used_anywhere(anywhere, groups[0].device)
        offset = 0
        for g in groups:
            for i, param, fresh in g.undecided:
                if anywhere[offset + i]:
                    run_grad_hooks(param)
                elif fresh:  # no rank used it: no gradient, as FSDP2's (a zero would still decay it)
                    param.grad = None
            offset += len(g.used_here)
        self._clear_used()

    def _used_anywhere(self, here: list[bool], device: torch.device) -> list[bool]:
        """``here`` OR-ed over all ranks. On the host: a GPU mesh's bytes go through a CPU (gloo) group
        made for them the first time, so reading the answer never waits for the GPU."""
        flags = torch.tensor(here, dtype=torch.uint8)
        if device.type == "cpu":
            flags = self.comm.all_reduce(flags, USED[1], op="max").wait()
        else:
            if self.flags_group is None:
                ranks = self.info.mesh.mesh.flatten().tolist()
                self.flags_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
            self.comm._count(*USED, flags.numel(), flags)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.flags_group)
        # train.estimate's fake world counts it and has no values to decide by: all used
        return [True] * len(here) if is_fake(flags) else [bool(x) for x in flags.tolist()]

    def _clear_used(self) -> None:
        for g in self.groups:
            g.used_here, g.undecided = None, []

    def check_params(self) -> None:
        """Refuse a tensor frozen when sharded and trained later (it has no gradient buffers), and
        meta-device tensors never given memory (``to_empty``)."""
        unset = [p.fqn for g in self.groups for p in g.params if not p.adopt_replaced() and p.unset]
        if unset:  # FSDP2 names the first group's (its lazy init stops there): the same names here
            first = next(g for g in self.groups if any(p.fqn in unset for p in g.params))
            unset = [p.fqn for p in first.params if p.fqn in unset]
            raise RuntimeError(f"FSDP parameters should be materialized from meta device before training, but the "
                               f"following were still on meta device: {unset}; call model.to_empty(device=...), then "
                               f"initialise them (reset_parameters, or load a state dict)")
        for g in self.groups:
            for p in g.params:
                if not p.trainable and p.param.requires_grad:
                    raise RuntimeError(f"{p.fqn}: requires_grad was False when the model was sharded, so it has no "
                                       f"gradient buffers; set requires_grad before fully_shard / paro_shard")

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Push the groups whose parameters' versions changed (a step, a load) to P; called after
        every optimizer step and at the root's pre-forward. Where safe, queued for the next forward,
        whose root starts them: nothing is in flight between steps, so a finished run exits with no
        collective pending (and none is issued at teardown)."""
        changed = [g for g in self.groups if g.trainable and g.params_version() != g.pushed_version]
        if not changed:
            return
        self.pushes.finish()
        for g in self.groups:
            g.reshard()  # a gathered copy (the root in eval, a prefetch, kept after backward) is stale
        for g in changed:
            g.pushed_version = g.params_version()
        if self.compiled_push is not None:
            self.compiled_push(changed)
            return
        deferred = [g for g in changed if push_dims(g)] if self._can_defer_push() else []
        drive([push_params(g) for g in changed if g not in deferred])  # local copies, or every push
        for g in deferred:  # root first: the order the next forward needs them
            self.pushes.queue(g, push_params(g), push_bytes(g))

    def _can_defer_push(self) -> bool:
        """Eager blocks only (a traced one reads P in its graph), once a forward showed the order,
        not under torch.profiler (gloo's wait crashed after it stopped), and no forward all-gather
        sharing a process group with a push."""
        if (self.training_state is TrainingState.NEW or any(b.traced for b in self.blocks)
                or torch.autograd._profiler_enabled()):
            return False
        gathers = set().union(*(forward_dims(g) for g in self.groups))
        return not any(push_dims(g) & gathers for g in self.groups)

    def install_hooks(self, blocks: list[ParoBlock] | None = None) -> None:
        for b in self.blocks if blocks is None else blocks:
            for module in b.modules:
                target = _inside_checkpoint(module)
                target.register_forward_pre_hook(b.pre_forward, with_kwargs=True)
                target.register_forward_hook(b.post_forward, with_kwargs=True)

    def register_sharded(self) -> None:
        """The sharded parameters on every module (the state dict's, ``_apply``'s view), the
        gathered tensors kept."""
        for g in self.groups:
            g.register_sharded()

    def reset_iter_state(self) -> None:
        """FSDP2's recovery after an exception in forward or backward: collectives land, groups
        reshard, the aborted (and unsynced) gradients are dropped; reduced ``.grad`` stays."""
        for _, g in self.in_flight:
            g.finish_grad_reduction()
        self.in_flight.clear()
        self.boundary.finish()
        self.pushes.finish()
        for g in self.groups:
            g.reshard()
            g.zero_grad()
            g.uses_left = 0
        self._clear_used()
        for b in self.blocks:
            b.to_run = set()
        self.forward_order = []
        if self.training_state is TrainingState.BACKWARD:
            self.training_state = TrainingState.IDLE
