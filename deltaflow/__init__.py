"""deltaflow: delta-rule linear attention with one recurrence and a table of step rules.

The design (recurrence, chunked algorithm, backward): docs/design.md. The public op is
:func:`delta_rule`; step rules live in :mod:`deltaflow.rules`.
"""

from deltaflow.ops import delta_rule, delta_rule_step
from deltaflow.rules import RULES, StepRule, get_rule, register_rule

__all__ = [
    "delta_rule",
    "delta_rule_step",
    "RULES",
    "StepRule",
    "get_rule",
    "register_rule",
]
__version__ = "0.1.0"
