"""deltaflow.tasks."""
