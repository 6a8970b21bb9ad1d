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
           seed_from: str | None = None, save_every: int = 0, resume: bool = False, model_only_from: str | None = None,
           dtype: str = "float32"):
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
    cfg.training.mixed_precision_param = dtype
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

    import logging

    from torchtitan.tools.logging import logger

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    lines, level = Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)  # torchtitan's init_logger level (the tests do not call it)
    try:
        trainer = cfg.build()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
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
    return {"rows": rows, "weights": weights, "log": lines.lines}


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
    """One rank: torchtitan FSDP2 runs that draw the 4 ranks' batches side by side (the
    single-process reference). Cases, in order: ``ref`` (the seed checkpoint, then 4 steps
    from it, saving steps 2 and 4: the interchange and model-only cases read them), ``ref_ga2``
    (2 micro-batches), ``ref_model_only`` (ref's step-4 weights loaded model-only),
    ``from_paro`` (FSDP2 resumes from a PaRO run's step-2 checkpoint, ``payload["paro_root"]``)."""
    root, out = payload["root"], {}
    seed = os.path.join(root, "seed", "checkpoint", "step-0")
    for case in payload["cases"]:
        if case == "ref":
            seed = seed_checkpoint(os.path.join(root, "seed"))
            out[case] = train(config(paro=False, emulate_world=4, seed_from=seed, folder=os.path.join(root, "ref"),
                                     save_every=2))
        elif case == "ref_ga2":
            out[case] = train(config(paro=False, emulate_world=4, accum=2, seed_from=seed,
                                     folder=os.path.join(root, case)))
        elif case == "ref_model_only":
            out[case] = train(config(paro=False, emulate_world=4, folder=os.path.join(root, case),
                                     model_only_from=os.path.join(root, "ref", "checkpoint", "step-4")))
        elif case == "from_paro":
            folder = os.path.join(root, case)
            _copy_step(os.path.join(root, "paro_IIG"), folder, 2)
            out[case] = train(config(paro=False, emulate_world=4, folder=folder, resume=True))
        else:
            raise ValueError(f"unknown case {case}")
    return out


# the 4-rank variants: name -> config keywords (each starts from the seed checkpoint)
VARIANTS: dict[str, dict[str, Any]] = {
    "ga2": {"strategy": "IIG", "accum": 2},
    "ac_full": {"strategy": "NIG", "ac": "full"},
    "ac_selective": {"strategy": "GGG", "ac": "selective"},
    "compile": {"strategy": "IIG", "compile": True},
    "compile_ac": {"strategy": "NNN", "compile": True, "ac": "full"},
}


def world(payload: dict) -> dict[str, Any]:
    """Four ranks (2 groups of 2), PaRO through torchtitan's Trainer. Cases, in order: a
    strategy name (4 steps from the seed checkpoint, a model-only load; IIG saves steps 2 and
    4), a ``VARIANTS`` name, ``resume`` (IIG's step 4 dropped: resumes from step 2), ``bf16`` and
    ``resume_bf16`` (the same in bf16),
    ``from_fsdp`` (the FSDP2 reference's step-2 checkpoint resumed on four ranks),
    ``model_only`` (the reference's step-4 weights loaded model-only, GGG)."""
    root, out = payload["root"], {}
    seed = os.path.join(root, "seed", "checkpoint", "step-0")
    for case in payload["cases"]:
        if case in VARIANTS:
            out[case] = train(config(seed_from=seed, folder=os.path.join(root, case), **VARIANTS[case]))
        elif case == "resume":
            folder = os.path.join(root, "paro_IIG")
            _drop_step(folder, 4)
            out[case] = train(config(strategy="IIG", folder=folder, resume=True))
        elif case == "bf16":  # torchtitan's default precision: bf16 P, fp32 masters; saves steps 2 and 4
            out[case] = train(config(strategy="IIG", seed_from=seed, folder=os.path.join(root, "paro_bf16"), save_every=2,
                                     dtype="bfloat16"))
        elif case == "resume_bf16":
            folder = os.path.join(root, "paro_bf16")
            _drop_step(folder, 4)
            out[case] = train(config(strategy="IIG", folder=folder, resume=True, dtype="bfloat16"))
        elif case == "from_fsdp":
            folder = os.path.join(root, case)
            _copy_step(os.path.join(root, "ref"), folder, 2)
            out[case] = train(config(strategy="IIG", folder=folder, resume=True))
        elif case == "model_only":
            out[case] = train(config(strategy="GGG", folder=os.path.join(root, case),
                                     model_only_from=os.path.join(root, "ref", "checkpoint", "step-4")))
        else:  # a strategy
            out[case] = train(config(strategy=case, seed_from=seed, folder=os.path.join(root, f"paro_{case}"),
                                     save_every=2 if case == "IIG" else 0))
    return out
