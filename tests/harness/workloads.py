"""Shared training workloads for the distributed tests: a tiny Llama, deterministic data,
a single-process reference run and the same run under paro_shard (``train_paro``; ``sharded``
and ``train_steps`` for a test's own loop, ``close`` to compare its losses)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
from paro_fsdp.models.llama import Llama, LlamaArgs

TINY = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=32)
# dim 0 of the embeddings, the output and w1 / w3 not divisible by 4 or 8 ranks: shards of
# different ranks differ in size (padding in the flat buffers, uneven PaRO-CC blocks)
ODD = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=67, ffn_dim=45, max_seq_len=32)
FROZEN = ("layers.0.attention.wq.weight", "layers.1.ffn_norm.weight", "norm.weight")
B, T, STEPS, LR, MAX_NORM = 2, 8, 3, 1e-3, 0.5


def make_model(seed: int = 0, args: LlamaArgs = TINY, frozen: tuple[str, ...] = FROZEN) -> Llama:
    torch.manual_seed(seed)
    model = Llama(args)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return model


def batch(rank: int, step: int, micro: int, args: LlamaArgs = TINY) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, args.vocab_size, (B, T + 1), generator=gen)


def reference(world: int, accum: int, args: LlamaArgs = TINY) -> dict[str, Any]:
    """Single process, global batch = every rank's micro-batch side by side."""
    model = make_model(args=args)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for a in range(accum):
            x = torch.cat([batch(r, step, a, args) for r in range(world)])
            loss = model(x).loss / accum
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append((total, norm.item()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def checkpoint_blocks(model: Llama) -> None:
    """Activation checkpointing of every block's whole module call, engine hooks included (the
    recomputation runs the hooks again inside backward)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.layers:
        call = block.__class__.__call__
        block.__class__ = type("Checkpointed", (block.__class__,), {
            "__call__": lambda self, *a, **k: checkpoint(call, self, *a, use_reentrant=False, **k)})


def compile_model(model, how: dict):
    """``how``: {"scope": "model" | "blocks", "backend": "aot" | "inductor", "passes": [...],
    "options": {...}}: ``passes.compile_model`` without the compiled push. Returns the model and
    the passes' record. "aot" runs the passes on AOTAutograd's graphs without inductor codegen."""
    import passes

    backend = how.get("backend", "aot")
    if backend == "inductor":
        torch._inductor.config.force_disable_caches = True  # a cache hit would skip the passes
    scope = how.get("scope", "model")
    record = passes.compile_model(model, how.get("passes", passes.ORDER), scope=scope, push=False,
                                  pass_options=passes.PassOptions(**how.get("options", {})), backend=backend,
                                  **({"fullgraph": True} if scope == "blocks" else {}))
    return model, record


def adamw(model) -> torch.optim.AdamW:
    """The references' optimizer, the FSDP2 way: torch's AdamW over the model's parameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)


def clip(model, max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over the model's parameters; the global norm as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def train_paro(strategy, group_size: int, accum: int, mp: MixedPrecision | None = None, steps: int = STEPS,
               ac: str | None = None, args: LlamaArgs = TINY, chunk_bytes: int | None = None,
               compile: dict | None = None, frozen: tuple[str, ...] = FROZEN):
    """The FSDP2 way: torch's AdamW over ``model.parameters()``, ``set_requires_gradient_sync``
    on the last micro-step (the boundary's reductions under its backward; A = 1: every
    backward), torch's ``clip_grad_norm_``. ``chunk_bytes``: PaRO-CC chunk size (the default
    leaves this tiny model's global collectives in one chunk; a few hundred bytes cuts them into
    several). ``compile``: see ``compile_model``; the record of the passes is left on
    ``model.paro_passes_record``."""
    mesh = init_paro_mesh(group_size)
    if compile is not None:
        torch._dynamo.reset()  # before paro_shard: a reset drops the compile-start callback that makes its sinks
    model = make_model(args=args, frozen=frozen)
    if ac == "wrapper":  # torch's checkpoint_wrapper around each block before sharding (FSDP2's order)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
        apply_activation_checkpointing(model, check_fn=lambda m: m in set(model.layers))
    elif ac:
        checkpoint_blocks(model)
    model = paro_shard(model, mesh, strategy, mp=mp)
    if chunk_bytes is not None:
        model._paro_state.cc.chunk_bytes = chunk_bytes
    opt = adamw(model)
    call = model
    if compile is not None:
        # the block hooks swap module parameters (a side effect): under a checkpointed block,
        # dynamo must not replay it in the recomputation (the graph recomputes, not Python)
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = bool(ac)
        call, model.paro_passes_record = compile_model(model, compile)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    model.comm_stats().reset()
    for step in range(steps):
        total = torch.zeros(())
        for a in range(accum):
            model.set_requires_gradient_sync(a == accum - 1)
            loss = call(batch(rank, step, a, args)).loss / accum
            loss.backward()
            total += loss.detach().float()
        norm = clip(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(((total / world).item(), norm.item()))
    return model, opt, losses


def full_params(model) -> dict[str, torch.Tensor]:
    """Whole parameters by name (torch's checkpoint_wrapper prefix dropped, as its state dict does)."""
    return {n.replace("._checkpoint_wrapped_module", ""): p.full_tensor().detach().float()
            for n, p in model.named_parameters()}


def sharded(mesh, strategy, model=None, **kw):
    """``make_model()`` (or ``model``) under ``paro_shard`` with the AdamW the references use."""
    model = paro_shard(model if model is not None else make_model(), mesh, strategy, **kw)
    return model, adamw(model)


def train_steps(model, opt, steps: int, *, loss_scale: float = 1.0, first_step: int = 0) -> list[tuple[float, float]]:
    """``steps`` optimizer steps of one micro-step each from step ``first_step``: (mean loss
    over ranks, grad norm) per step; the loss is scaled by ``loss_scale`` before backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in range(first_step, first_step + steps):
        loss = model(batch(rank, step, 0)).loss
        (loss * loss_scale).backward()
        norm = clip(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out.append(((total / world).item(), norm.item()))
    return out


def close(got_losses, ref_losses, scale: float = 1.0) -> None:
    """(loss, grad norm) per step to 1e-5 relative; the norm against ``scale`` times the reference's."""
    assert len(got_losses) == len(ref_losses)
    for (loss, norm), (ref_loss, ref_norm) in zip(got_losses, ref_losses):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert abs(norm - scale * ref_norm) <= 1e-5 * abs(scale * ref_norm) + 1e-7, (norm, scale * ref_norm)


#: the trainer on the debug Llama, IIG on 2 x 2 gloo ranks, fp32: what the torchrun tests start from
TRAINER_ARGS = [
    "--model.flavor", "debug", "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--training.global_batch_size", "8", "--training.mixed_precision_param", "float32",
    "--training.mixed_precision_reduce", "float32", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2",
    "--lr_scheduler.decay_type", "constant", "--parallelism.paro_strategy", "IIG", "--parallelism.paro_group_size",
    "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--comm.backend", "gloo",
]
