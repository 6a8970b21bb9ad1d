"""What the ranks of the torchtitan tests run: torchtitan's real Trainer on the debug Llama 3
(SDPA, fp32, seq 32), through ``ParoTrainer`` (PaRO, or FSDP2 with ``paro.enable = False``).

Every run starts from one seed checkpoint (torchtitan's ``create_seed_checkpoint``, written by a
single-rank FSDP2 trainer) loaded model-only through ``checkpoint.initial_load_path``, so the
strategies, the FSDP2 reference and the resumed runs all start from the same weights."""
from __future__ import annotations

import os
from typing import Any

import titan_shims  # noqa: F401  (before torchtitan)
from titan_shims import SynthLoader, SynthTokenizer, sdpa_model_spec

B, T = 2, 32


def config(*, paro: bool = True, strategy: str = "IIG", group_size: int = 2, steps: int = 4, accum: int = 1,
           emulate_world: int = 0, ac: str | None = None, compile: bool = False, folder: str | None = None,
           seed_from: str | None = None, save_every: int = 0, resume: bool = False, model_only_from: str | None = None):
    """A ``ParoTrainer.Config``: local batch ``B`` per rank (``B * emulate_world`` in a
    single-process reference), ``accum`` micro-batches per step."""
    import torch.distributed as dist
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from paro_fsdp.integrations.torchtitan import to_paro

    cfg = llama3_debugmodel()
    cfg.model_spec = sdpa_model_spec()
    cfg.loss = getattr(cfg.loss, "loss_fn", cfg.loss)  # unchunked on both sides (ParoTrainer unchunks it)
    cfg.tokenizer = SynthTokenizer.Config()
    cfg.dataloader = SynthLoader.Config(emulate_world=emulate_world)
    local = B * max(emulate_world, 1)
    cfg.training.local_batch_size = local
    cfg.training.global_batch_size = local * dist.get_world_size() * accum
    cfg.training.seq_len = T
    cfg.training.steps = steps
    cfg.training.mixed_precision_param = "float32"
    cfg.validator.enable = False
    cfg.metrics.log_freq = 1
    cfg.metrics.enable_tensorboard = False
    cfg.activation_checkpoint = {None: None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[ac]
    cfg.compile = CompileConfig(enable=compile, components=["model"], backend="aot_eager")
    cfg.dump_folder = folder or "/tmp/paro_titan_unused"
    ck = cfg.checkpoint
    ck.enable = bool(save_every or resume or seed_from or model_only_from)
    ck.folder = "checkpoint"
    ck.interval = save_every or 10_000
    ck.last_save_model_only = False
    if seed_from or model_only_from:
        ck.initial_load_path = seed_from or model_only_from
        ck.initial_load_model_only = True
    return to_paro(cfg, enable=paro, strategy=strategy, group_size=group_size)


def train(cfg) -> dict[str, Any]:
    """Build the trainer from its config (as torchtitan.train does), train, and return the
    logged (step, loss, grad norm) and the final full weights."""
    import torch

    trainer = cfg.build()
    owner = trainer if hasattr(trainer, "titan_log") else trainer.metrics_processor  # PaRO logs its own norm
    attr = "titan_log" if owner is trainer else "log"
    log, rows = getattr(owner, attr), []

    def record(step, loss, max_loss, grad_norm, extra_metrics=None):
        rows.append((int(step), float(loss), float(grad_norm)))
        return log(step, loss, max_loss, grad_norm, extra_metrics=extra_metrics)

    setattr(owner, attr, record)
    try:
        trainer.train()
        model = trainer.model_parts[0]
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
                   for n, p in model.state_dict().items() if torch.is_floating_point(p)}
    finally:
        trainer.close()
    return {"rows": rows, "weights": weights}


def seed_checkpoint(folder: str) -> str:
    """torchtitan's seed checkpoint (``--checkpoint.create_seed_checkpoint`` on one rank)."""
    cfg = config(paro=False, folder=folder, save_every=1)
    cfg.checkpoint.create_seed_checkpoint = True
    trainer = cfg.build()
    trainer.checkpointer.save(curr_step=0, last_step=True)
    trainer.close()
    return os.path.join(folder, "checkpoint", "step-0")


def _copy_step(src: str, dst_folder: str, step: int) -> None:
    """Rank 0 copies checkpoint ``step-<step>`` of ``src`` into ``dst_folder``'s checkpoints."""
    import shutil

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(src, "checkpoint", f"step-{step}"),
                        os.path.join(dst_folder, "checkpoint", f"step-{step}"))
    dist.barrier()


def _drop_step(folder: str, step: int) -> None:
    import shutil

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(folder, "checkpoint", f"step-{step}"))
    dist.barrier()


def single(payload: dict) -> dict[str, Any]:
    """One rank: the seed checkpoint and torchtitan FSDP2 references that emulate the 4-rank
    batch (A = 1 and A = 2); the A = 1 run saves steps 2 and 4 (for the interchange). With
    ``from_paro``: FSDP2 resumes from a PaRO run's step-2 checkpoint instead."""
    root, out = payload["root"], {}
    if payload.get("from_paro"):
        folder = os.path.join(root, "fsdp_from_paro")
        _copy_step(payload["from_paro"], folder, 2)
        out["from_paro"] = train(config(paro=False, emulate_world=4, folder=folder))
        return out
    seed = seed_checkpoint(os.path.join(root, "seed"))
    out["ref"] = train(config(paro=False, emulate_world=4, seed_from=seed, folder=os.path.join(root, "ref"), save_every=2))
    out["ref_ga2"] = train(config(paro=False, emulate_world=4, accum=2, seed_from=seed, folder=os.path.join(root, "ref_ga2")))
    return out


def world(payload: dict) -> dict[str, Any]:
    """Four ranks (2 groups of 2): PaRO runs through torchtitan's Trainer, each from the seed
    checkpoint (a model-only load), and the resumes."""
    root, out = payload["root"], {}
    seed = os.path.join(root, "seed", "checkpoint", "step-0")
    for s in payload.get("strategies", []):
        out[s] = train(config(strategy=s, seed_from=seed, folder=os.path.join(root, f"paro_{s}"),
                              save_every=2 if s == "IIG" else 0))
    for name, kw in payload.get("variants", {}).items():
        out[name] = train(config(seed_from=seed, folder=os.path.join(root, name), **kw))
    if payload.get("resume"):  # IIG saved steps 2 and 4: drop 4, resume from 2
        folder = os.path.join(root, "paro_IIG")
        _drop_step(folder, 4)
        out["resume"] = train(config(strategy="IIG", folder=folder))
    if payload.get("from_fsdp"):  # torchtitan FSDP2 (one rank) step 2 -> PaRO on four ranks
        folder = os.path.join(root, "paro_from_fsdp")
        _copy_step(os.path.join(root, "ref"), folder, 2)
        out["from_fsdp"] = train(config(strategy="IIG", folder=folder))
    if payload.get("model_only"):  # trained weights (FSDP2 step 4) loaded without optimizer state
        out["model_only"] = train(config(strategy="GGG", model_only_from=os.path.join(root, "ref", "checkpoint", "step-4"),
                                         folder=os.path.join(root, "model_only")))
    return out
