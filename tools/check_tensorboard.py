"""Check in a real headless browser that TensorBoard shows a training run's scalars, step
timelines (the Images tab) and traces: ``paro_fsdp/train/tensorboard_check.py``.

    python -m tools.check_tensorboard --logdir outputs/debug_paro [--screenshot-dir outputs/tb_check]
"""
import sys

from paro_fsdp.train.tensorboard_check import main

if __name__ == "__main__":
    sys.exit(main())
