"""deltaflow.analysis."""
