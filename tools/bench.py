"""The headline benchmark on the emulated cluster (root): every named PaRO strategy and the
advisor's pick against FSDP2 ZeRO-3 / HSDP / ``reshard_after_forward=m`` and torch DDP; with
``--compiled`` the compiled variants and each graph pass alone (``compiled_emulated.py``).

    python -m tools.bench [--quick] [--trainable 0.0625] [--dtype bf16] [--nodes 2 --ranks-per-node 4]
    python -m tools.bench --compiled [--strategies GGG,IGG] [--quick] [--backend aot]   # compiled variants
    python -m tools.emulate -- -m tools.bench   # the same worker through the emulator CLI

The command line of ``paro_fsdp.bench.headline`` (its docstring and ``--help`` say the rest).
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: importing the package loads it

from paro_fsdp.bench.headline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
