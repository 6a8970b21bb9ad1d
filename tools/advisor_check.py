"""Predicted vs measured step time on local CPU ranks, after calibrating them:

    python -m tools.advisor_check [--nproc 4 --group-size 2] [--strategies NNN,GGG,III] [--out cpu_check.toml]

The command line of ``paro_fsdp.bench.advisor_check`` (its docstring and ``--help`` say the rest).
"""
import sys

from paro_fsdp.bench.advisor_check import main

if __name__ == "__main__":
    sys.exit(main())
