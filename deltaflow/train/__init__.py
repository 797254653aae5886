"""deltaflow.train."""
