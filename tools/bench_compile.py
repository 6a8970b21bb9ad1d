"""Eager vs torch.compile vs torch.compile + the graph passes, and FSDP2 + torch.compile, on 4 CPU
gloo ranks: step-time ratios and cold / warm compile times.

    python -m tools.bench_compile [--strategies GGG IIG NGG --rounds 6]

The command line of ``paro_fsdp.bench.compiled`` (its docstring and ``--help`` say the rest).
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: importing the package loads it

from paro_fsdp.bench.compiled import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
