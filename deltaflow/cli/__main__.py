"""``python -m deltaflow.cli``: the ``deltaflow`` command (also under torchrun)."""

import sys

from deltaflow.cli import main

sys.exit(main())
