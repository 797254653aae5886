"""deltaflow.layers."""
