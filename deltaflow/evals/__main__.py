"""``python -m deltaflow.evals``: lm-eval's command line with the ``deltaflow`` model class."""

from deltaflow.evals.harness import main

main()
