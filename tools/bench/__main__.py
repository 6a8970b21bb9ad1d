"""``python -m tools.bench``: the headline benchmark (``headline.py`` says what it runs)."""
import sys

from .headline import main

sys.exit(main())
