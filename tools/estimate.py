"""Per-rank memory and per-step communication of every PaRO strategy, counted by the engine.

    python -m tools.estimate --model llama7b --world 64 --group 8 [--strategies IIG,GGG]
        [--micro-batch 1 --seq-len 16 --grad-accum 4] [--trainable-fraction 1.0] [--dtype bf16]
        [--full] [--json]

The command line of ``paro_fsdp.cost.estimate`` (its docstring and ``--help`` say the rest).
"""
import sys

from paro_fsdp.cost.estimate import main

if __name__ == "__main__":
    sys.exit(main())
