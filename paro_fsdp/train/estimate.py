"""The engine's own count of every PaRO strategy's per-rank memory and per-step communication,
on a fake world: ``estimate(...)`` (``train.py --estimate``, ``python -m tools.estimate``).

Why: ``cost.ledger`` says what each strategy *should* cost; this measures what the engine *does*,
at any world size, without hardware: one optimizer step per strategy on torch's fake process group
under ``FakeTensorMode``. ``clip_grad_norm_``'s all-reduces are DTensor's, so neither the measured
bytes nor the formulas (``clip=False``) count them. Needs a process without a real process group.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from ..api import paro_shard
from ..cost.ledger import formula_bytes, formula_memory
from ..cost.model import model_spec
from ..dtypes import DTYPES, short_name
from ..mesh import init_paro_mesh
from ..mixed_precision import MixedPrecision
from ..models.llama import Llama, LlamaArgs, flavor
from ..strategy import ALL_STRATEGIES, Strategy

GiB, GB = 2**30, 1e9

_meshes: dict[tuple[int, int], Any] = {}


def ensure_fake_world(world: int) -> None:
    """Make this process rank 0 of a fake ``world``-rank group (a real one: error, it would issue real collectives)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(f"estimate() needs a process without a real process group (found backend "
                               f"{dist.get_backend()!r}); run it before init_process_group or in its own process")
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()
        _meshes.clear()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def release_fake_world() -> None:
    """Tear down the fake process group and cached meshes."""
    _meshes.clear()
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


def fake_mesh(world: int, group: int):
    """The fake (world // group, group) mesh, once per shape (outside FakeTensorMode: DeviceMesh keeps real ranks)."""
    ensure_fake_world(world)
    if (world, group) not in _meshes:
        _meshes[world, group] = init_paro_mesh(group)
    return _meshes[world, group]


def _measure(args: LlamaArgs, pattern: Sequence[bool], root_trainable: bool, mesh: Any, strategy: str,
             mp: MixedPrecision, grad_accum: int, micro_batch: int, seq_len: int, max_norm: float,
             flat_below_bytes: int = 0) -> dict[str, float]:
    """One engine step of a fake model (``pattern[i]``: layer i trainable): counted collectives and held bytes."""
    with FakeTensorMode():
        model = Llama(replace(args, n_layers=len(pattern)))
        for name, p in model.named_parameters():
            p.requires_grad_(pattern[int(name.split(".")[1])] if name.startswith("layers.") else root_trainable)
        model = paro_shard(model, mesh, strategy, mp=mp, flat_below_bytes=flat_below_bytes)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1, fused=True)
        stats = model.comm_stats()
        stats.reset()
        for micro in range(grad_accum):
            model.set_requires_gradient_sync(micro == grad_accum - 1)  # the trainer's: the boundary once per step
            tokens = torch.randint(0, args.vocab_size, (micro_batch, seq_len + 1))
            (model(tokens).loss / grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        opt.step()
        model.wait_for_params()  # the step's pushes (they would land in the next forward)
        memory = model.memory_report(opt)
        opt.zero_grad()
    out = {f"mem:{k}": float(v) for k, v in memory.items()}
    for key, entry in stats.as_dict().items():
        out[f"count:{key}"] = float(entry["count"])
        out[f"bytes:{key}"] = float(entry["bytes"])
    return out


def _combine(terms: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for coef, vec in terms:
        for k, v in vec.items():
            out[k] = out.get(k, 0.0) + coef * v
    return {k: v for k, v in out.items() if abs(v) > 1e-9 or k.startswith("mem:")}


def _measure_extrapolated(args: LlamaArgs, t: int, full: bool, **kw: Any) -> tuple[dict[str, float], str]:
    """Measured vector of the full-depth model: run directly (``full``) or from 1-2 layer runs."""
    L = args.n_layers
    root_trainable = t == L
    if full or L <= 2:
        return _measure(args, [True] * t + [False] * (L - t), root_trainable, **kw), f"{L}"
    one = _measure(args, [True], root_trainable, **kw)
    two = _measure(args, [True, True], root_trainable, **kw)
    per_trainable = _combine([(1, two), (-1, one)])
    root = _combine([(1, one), (-1, per_trainable)])
    terms = [(1, root), (t, per_trainable)]
    runs = "1,2"
    if t < L:
        frozen = _measure(args, [True, False], root_trainable, **kw)
        terms.append((L - t, _combine([(1, frozen), (-1, one)])))
        runs = "1,2,2(1 frozen)"
    return _combine(terms), f"{runs} -> {L}"


def estimate(model: Union[str, LlamaArgs] = "llama7b", world: int = 64, group: int = 8,
             strategies: Optional[Sequence[str]] = None, grad_accum: int = 4, trainable_fraction: float = 1.0,
             dtype: str = "bf16", reduce_dtype: Optional[str] = None, micro_batch: int = 1, seq_len: int = 16,
             full: bool = False, max_norm: float = 1.0, accumulate_dtype: Optional[str] = "fp32",
             flat_below_bytes: int = 0) -> list[dict[str, Any]]:
    """Measure each strategy on a fake ``world``-rank mesh (``model``: flavor name or ``LlamaArgs``), the ledger's
    formulas beside it: one dict per strategy, bytes per rank per optimizer step of ``grad_accum`` micro-steps
    (``formula_*_bytes`` always hierarchical, whatever ``flat_below_bytes``); a refused strategy gets ``error``."""
    args = flavor(model) if isinstance(model, str) else model
    if seq_len > args.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len {args.max_seq_len}")
    if any(d is not None and d not in DTYPES for d in (dtype, reduce_dtype, accumulate_dtype)) or dtype is None:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r} / {reduce_dtype!r} / "
                         f"{accumulate_dtype!r}")
    names = [Strategy.parse(s).name for s in (strategies or ALL_STRATEGIES)]
    mp = MixedPrecision(DTYPES[dtype], DTYPES[reduce_dtype] if reduce_dtype else None,
                        DTYPES[accumulate_dtype] if accumulate_dtype else None)
    pb, gb, ab = mp.param_dtype.itemsize, mp.grad_dtype.itemsize, mp.acc_dtype.itemsize  # ab: the G accumulator's
    mesh = fake_mesh(world, group)

    spec = model_spec(args, trainable_fraction)  # the first t layers train, the root only with all of them
    t, root, psi, psi_t = spec.trainable_layers, spec.root, spec.psi, spec.psi_trainable
    kw = dict(mesh=mesh, mp=mp, grad_accum=grad_accum, micro_batch=micro_batch, seq_len=seq_len, max_norm=max_norm,
              flat_below_bytes=flat_below_bytes)

    rows = []
    for name in names:
        row: dict[str, Any] = {"strategy": name, "known_as": Strategy.parse(name).known_as, "psi": psi,
                               "psi_trainable": psi_t, "psi_kept": root, "n": world, "m": group,
                               "grad_accum": grad_accum, "param_bytes": pb, "grad_bytes": gb}
        try:
            vec, runs = _measure_extrapolated(args, t, full, strategy=name, **kw)
        except ValueError as e:
            row["error"] = str(e)
            rows.append(row)
            continue
        row["layers_run"] = runs
        row.update({f"mem_{k}": vec.get(f"mem:{k}", 0.0) for k in ("P", "G", "OS", "total")})
        fm = formula_memory(name, psi, psi_t, world, group, pb, ab)
        row.update({f"formula_mem_{k}": fm[k] for k in ("P", "G", "OS", "total")})
        collectives: dict[str, dict[str, float]] = {}
        for key, v in vec.items():
            if key.startswith(("count:", "bytes:")):
                what, kd = key.split(":", 1)
                collectives.setdefault(kd, {})[what] = v
        row["collectives"] = collectives
        for dim in ("intra", "inter", "global"):
            row[f"{dim}_bytes"] = sum(e.get("bytes", 0.0) for kd, e in collectives.items() if kd.endswith("/" + dim))
        fb = formula_bytes(name, psi, psi_t, world, group, grad_accum, psi_kept=root, param_bytes=pb, grad_bytes=gb)
        row.update({f"formula_{dim}_bytes": fb[dim] for dim in ("intra", "inter", "global")})
        rows.append(row)
    return rows


def _ratio(a: float, b: float) -> str:
    if b == 0:
        return "  -   " if a == 0 else "  inf "
    return f"{a / b:6.4f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """``estimate``'s rows as a table: measured beside formula (ratio above 1 only where the layout pads dim 0)."""
    ok = [r for r in rows if "error" not in r]
    big_mem = max((r["mem_total"] for r in ok), default=0) >= GiB / 8
    big_comm = max((r["intra_bytes"] + r["inter_bytes"] for r in ok), default=0) >= GB / 8
    mu, ms = ("GiB", GiB) if big_mem else ("MiB", 2**20)
    cu, cs = ("GB", GB) if big_comm else ("MB", 1e6)
    head = (f"{'strat':5} {'known as':24} | {'P':>7} {'G':>7} {'OS':>7} {'total':>8} {'formula':>8} {'ratio':>6} |"
            f" {'intra':>8} {'formula':>8} {'ratio':>6} | {'inter':>8} {'formula':>8} {'ratio':>6}")
    unit = (f"{'':5} {'':24} | {mu:>7} {mu:>7} {mu:>7} {mu:>8} {mu:>8} {'':>6} |"
            f" {cu:>8} {cu:>8} {'':>6} | {cu:>8} {cu:>8} {'':>6}")
    lines = [head, unit, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['strategy']:5} {r['known_as'][:24]:24} | error: {r['error'][:100]}")
            continue
        lines.append(f"{r['strategy']:5} {r['known_as'][:24]:24} | {r['mem_P'] / ms:7.3f} {r['mem_G'] / ms:7.3f}"
                     f" {r['mem_OS'] / ms:7.3f} {r['mem_total'] / ms:8.3f} {r['formula_mem_total'] / ms:8.3f}"
                     f" {_ratio(r['mem_total'], r['formula_mem_total'])} |"
                     f" {r['intra_bytes'] / cs:8.2f} {r['formula_intra_bytes'] / cs:8.2f}"
                     f" {_ratio(r['intra_bytes'], r['formula_intra_bytes'])} |"
                     f" {r['inter_bytes'] / cs:8.3f} {r['formula_inter_bytes'] / cs:8.3f}"
                     f" {_ratio(r['inter_bytes'], r['formula_inter_bytes'])}")
    return "\n".join(lines)


def run_estimate(cfg: Any, world: Optional[int]) -> int:
    """``train.py --estimate --world N``: ``estimate`` of ``cfg``'s strategy beside ZeRO-3 (GGG); ``"auto"`` ranks
    the strategies on the cluster file first. Returns the exit status."""
    from .config import grad_accum_steps, group_size, tokenizer_spec
    from .parallelize import advise, model_args
    from .tokenizer import build_tokenizer

    if not world:
        print("train.py: error: --estimate needs --world N (the number of ranks to estimate for)", file=sys.stderr)
        return 2
    t, p = cfg.training, cfg.parallelism
    m = group_size(cfg, world, local_world_size=min(8, world))
    accum = grad_accum_steps(cfg, world)
    chosen = p.paro_strategy.upper()
    try:
        args = model_args(cfg, build_tokenizer(tokenizer_spec(cfg)).vocab_size)
        if chosen == "AUTO":  # rank the strategies on the cluster file (default: the A100 preset)
            best, table = advise(cfg, args, world, m, accum, p.paro_cluster_file or "a100_ib")
            print(table)
            chosen = best.name
    except (FileNotFoundError, RuntimeError, ValueError) as exc:  # AdvisorError is a ValueError
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter()
    rows = estimate(args, world, m, [chosen] + (["GGG"] if chosen != "GGG" else []), grad_accum=accum,
                    dtype=short_name(t.mixed_precision_param), reduce_dtype=short_name(t.mixed_precision_reduce),
                    max_norm=t.max_norm if t.max_norm > 0 else 1.0,
                    accumulate_dtype=short_name(t.mixed_precision_accumulate))
    what = f"hf {cfg.model.hf_path} (as a Llama of its shapes)" if cfg.model.name == "hf" else cfg.model.flavor
    print(f"{cfg.job.config_file or 'default config'}: {what}, {rows[0]['psi'] / 1e9:.3f} B parameters, "
          f"{world} ranks = {world // m} groups x {m}, {accum} micro-steps of {t.local_batch_size} x {t.seq_len} "
          f"tokens per rank per step, P {t.mixed_precision_param}, G {t.mixed_precision_reduce} on the wire and "
          f"{t.mixed_precision_accumulate} accumulated, OS fp32 {cfg.optimizer.name}")
    print("per rank: model-state memory (P, G, OS) and bytes sent per optimizer step, measured through the engine "
          "on a fake process group, beside the spec's formulas (activations not included)")
    print(format_table(rows))
    if p.paro_policy:
        print(f"note: the per-tensor paro_policy {p.paro_policy} is not modelled; every tensor uses {p.paro_strategy}")
    if p.inter_dtype != "none":
        print(f"note: parallelism.inter_dtype = {p.inter_dtype} is not modelled here: the bytes are the exact wire's "
              f"(python -m tools.advisor --inter-dtype {p.inter_dtype} prices it)")
    print(f"({time.perf_counter() - wall:.1f} s)")
    return 0
