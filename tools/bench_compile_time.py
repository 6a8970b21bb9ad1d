"""The first (compiling) training step, cold and warm: PaRO whole-model and per-block compile
against FSDP2 + per-block compile, on the debug model on 4 CPU gloo ranks.

    python -m tools.bench_compile_time [--variants paro-model,paro-blocks,fsdp2 --strategy IIG]

The command line of ``paro_fsdp.bench.compile_time`` (its docstring and ``--help`` say the rest).
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: importing the package loads it

from paro_fsdp.bench.compile_time import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
