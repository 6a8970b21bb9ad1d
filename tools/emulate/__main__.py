"""``python -m tools.emulate``: a torchrun job on the emulated cluster (``launch.py``'s command line)."""
import sys

from .launch import main

sys.exit(main())
