"""Per-rank memory and per-step communication of every PaRO strategy, counted by the engine.

    python -m tools.estimate --model llama7b --world 64 --group 8 [--strategies IIG,GGG]
        [--micro-batch 1 --seq-len 16 --grad-accum 4] [--trainable-fraction 1.0] [--dtype bf16]
        [--full] [--json]

Why this exists: the ledger (``paro_fsdp.cost.ledger``) says what each strategy *should* cost;
this tool measures what the engine *does*. In one process it starts torch's fake process group
(``world`` simulated ranks, this process is rank 0) and, under ``FakeTensorMode`` (tensors carry
shapes only, so a 7B model costs no memory and no FLOPs), for each strategy it builds the Llama
model, ``paro_shard``s it on the (world/group, group) ("inter", "intra") mesh, builds torch's
AdamW over its trainable parameters (FSDP2's contract) and runs one real optimizer step of A
micro-steps (forward, backward with ``set_requires_gradient_sync`` on the last one, torch's
``clip_grad_norm_``, ``step``) through the engine. ``model.comm_stats()`` then holds the
collectives the engine actually issued and ``model.memory_report(opt)`` the model states it
holds; both are printed next to the spec's formulas (``paro_fsdp.cost.ledger``) with their ratio.

Defaults and shortcuts, and why they do not change the answer:
- ``--seq-len 16 --micro-batch 1``: activations do not enter model-state memory or collective
  bytes, and a short sequence keeps the fake compute cheap.
- AdamW runs with ``fused=True``: its other implementations call ``.item()`` on the step
  counter, which fake tensors cannot answer. Same states (fp32 exp_avg, exp_avg_sq: 8 bytes per
  trainable element, + 4 for the fp32 master = the spec's K = 12).
- Depth: by default each strategy runs on the flavor's exact shapes with 1 and 2 transformer
  layers (and a third model with one frozen layer when part of the model is frozen), and the
  counts are extended to the full depth linearly. That is exact, not an approximation: every
  layer is a separate engine block with identical shapes and identical collectives, and the root
  block (embeddings, final norm, output) is the same at any depth, so each measured quantity is
  root + (#trainable layers) x per-trainable-layer + (#frozen layers) x per-frozen-layer.
  Running all 32 layers of LLaMA-7B through fake tensors costs ~15 s CPU per strategy on this
  2-core machine, too slow for 27 strategies; ``--full`` does it anyway (and the test checks
  that both agree on a 4-layer model).
- World size: the layout's work is per tensor, not per rank (indices of uneven shards are built
  once per size and mesh), so ``--world 1024`` costs about what ``--world 64`` does (~1 min for
  all 27 strategies of LLaMA-7B on 2 idle cores); tests/test_estimate.py guards that.
- ``--trainable-fraction f``: trainable parameters are whole transformer layers, the first t of
  them (t >= 1 chosen so that t x layer size is closest to f x Psi); with f < 1 every other
  parameter, the root's included, is frozen (requires_grad=False). Frozen layers after the
  trainable ones still run backward (gradients flow to the earlier trainable layers), so they
  are gathered twice per micro-step, like the spec assumes. The realised fraction is printed.
  With f = 1 everything is trainable.

The counting itself is ``paro_fsdp.train.estimate`` (the trainer's ``--estimate`` uses it too).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, Sequence

from paro_fsdp.models.llama import FLAVORS
from paro_fsdp.train.estimate import DTYPES, estimate, format_table


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama7b", choices=sorted(FLAVORS))
    ap.add_argument("--world", type=int, default=64, help="simulated ranks n")
    ap.add_argument("--group", type=int, default=8, help="ranks per group m (e.g. GPUs per node)")
    ap.add_argument("--strategies", default=None, help="comma-separated, e.g. IIG,GGG (default: all 27)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=16, help="short by default: activations do not affect the result")
    ap.add_argument("--grad-accum", type=int, default=4, help="micro-steps A per optimizer step")
    ap.add_argument("--trainable-fraction", type=float, default=1.0)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="parameter (and default gradient) dtype")
    ap.add_argument("--reduce-dtype", default=None, choices=sorted(DTYPES), help="gradient dtype (default: --dtype)")
    ap.add_argument("--full", action="store_true", help="run every layer instead of extending 1-2 layer runs (slow)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    a = ap.parse_args(argv)
    wall, cpu = time.perf_counter(), time.process_time()
    rows = estimate(a.model, a.world, a.group, a.strategies.split(",") if a.strategies else None, a.grad_accum,
                    a.trainable_fraction, a.dtype, a.reduce_dtype, a.micro_batch, a.seq_len, a.full)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    r0 = rows[0]
    print(
        f"{a.model}: Psi = {r0['psi'] / 1e9:.3f} B params, Psi' = {r0['psi_trainable'] / 1e9:.3f} B "
        f"({r0['psi_trainable'] / r0['psi']:.1%} trainable), kept gathered fwd->bwd (root) = "
        f"{r0['psi_kept'] / 1e6:.1f} M; "
        f"n = {a.world}, m = {a.group}, A = {a.grad_accum}, P {a.dtype}, G {a.reduce_dtype or a.dtype}, OS fp32 AdamW; "
        f"layers run: {r0.get('layers_run', '-')}"
    )
    print(
        "per rank: model-state memory after the step (memory_report); bytes sent per optimizer step (comm_stats, "
        "ring cost)"
    )
    print(format_table(rows))
    print(f"(flat collectives over all ranks: {r0.get('global_bytes', 0):.3f} bytes, formula "
          f"{r0.get('formula_global_bytes', 0):.3f}; the clip's norm all-reduce is DTensor's, counted by neither)")
    print(f"{len(rows)} strategies in {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
