"""``python -m mla``: the ``mla`` console script."""
import sys

from .cli import main

sys.exit(main())
