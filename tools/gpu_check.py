"""One command that checks the CUDA + NCCL path on one GPU (the trainer, every engine buffer on
the device, memory, tokens/s and MFU against FSDP2, four ranks over the engine's streams, the CUDA
sanitizer); it refuses without CUDA:

    python -m tools.gpu_check [--out gpu_check.json] [--parts a,b,c,d,e] [--workdir outputs/gpu_check]
    python -m tools.gpu_check --dry-run        # the plan and every command it would run; no GPU needed

The command line of ``paro_fsdp.gpu_check.cli`` (its docstring and ``--help`` say the rest).
"""
import sys

from paro_fsdp.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
