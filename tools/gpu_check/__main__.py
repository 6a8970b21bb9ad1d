"""``python -m tools.gpu_check``: the GPU check (``cli.py`` says what each part checks)."""
import sys

from .cli import main

sys.exit(main())
