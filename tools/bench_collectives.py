"""PaRO-CC against the flat gloo collective on the emulated cluster (root):

    python -m tools.bench_collectives --nodes 2 --ranks-per-node 2 --inter-rate 200mbit [--quick]
    python -m tools.emulate --topology rails -- -m tools.bench_collectives --sizes-mb 1,16

The command line of ``paro_fsdp.bench.collectives`` (its docstring and ``--help`` say the rest).
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: importing the package loads it

from paro_fsdp.bench.collectives import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
