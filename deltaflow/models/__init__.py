"""deltaflow.models."""
