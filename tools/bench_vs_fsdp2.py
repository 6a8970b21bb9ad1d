"""Step time of PaRO GGG / III against FSDP2 ZeRO-3 / HSDP on 4 CPU gloo ranks it spawns itself:

    python -m tools.bench_vs_fsdp2 [--profile]          # also `make bench-fsdp2`
    torchrun --nproc-per-node 4 -m tools.bench_vs_fsdp2

The command line of ``paro_fsdp.bench.vs_fsdp2`` (its docstring and ``--help`` say the rest).
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: importing the package loads it

from paro_fsdp.bench.vs_fsdp2 import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
