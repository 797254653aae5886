"""The recurrence: reference (``naive``), chunked PyTorch (``chunk``), Triton, and decode."""

from deltaflow.ops.delta_rule import delta_rule
from deltaflow.ops.step import delta_rule_step

__all__ = ["delta_rule", "delta_rule_step"]
