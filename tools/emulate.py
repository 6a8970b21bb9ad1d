"""Run a torchrun job on an emulated multi-node cluster (network namespaces, tc-shaped links; root):

    python -m tools.emulate --nodes 2 --ranks-per-node 2 --inter-rate 200mbit --inter-delay 1ms \\
        [--topology shared|rails] -- train.py --job.config_file train_configs/debug_paro.toml
    python -m tools.emulate --cleanup          # remove what crashed runs left behind

The command line of ``paro_fsdp.bench.launch`` (``paro_fsdp.bench.emulator``'s docstring says how
the cluster is built and why).
"""
import sys

from paro_fsdp.bench.launch import main

if __name__ == "__main__":
    sys.exit(main())
