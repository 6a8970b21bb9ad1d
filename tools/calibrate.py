"""Measure the real mesh and write a cluster file the advisor reads: ``python -m tools.calibrate
--help`` (the command line of ``paro_fsdp.cost.calibrate``, whose CLI_DOC says what it measures)."""
import sys

from paro_fsdp.cost.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
