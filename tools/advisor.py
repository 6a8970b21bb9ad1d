"""Which PaRO strategy to run: every strategy's predicted step time and memory, ranked.

    python -m tools.advisor --model llama7b --gpus 64 --gpus-per-node 8 --cluster a100_ib.toml \\
        --micro-batch 2 --grad-accum 4 [--trainable 0.0625] [--plot out.png | --no-plot]

The command line of ``paro_fsdp.cost.report`` (its docstring and ``--help`` say the rest).
"""
import sys

from paro_fsdp.cost.report import main

if __name__ == "__main__":
    sys.exit(main())
