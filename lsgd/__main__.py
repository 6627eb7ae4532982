"""``python -m lsgd`` is the ``lsgd`` command."""

import sys

from .cli import main

sys.exit(main())
