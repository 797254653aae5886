"""deltaflow: delta-rule linear attention with one recurrence and a table of step rules.

See DESIGN notes in the README. The public op is :func:`delta_rule`; step rules live in
:mod:`deltaflow.rules`.
"""

from deltaflow.ops import delta_rule, delta_rule_step
from deltaflow.ops.checks import set_value_checks
from deltaflow.rules import RULES, StepRule, get_rule, register_rule

__all__ = [
    "delta_rule",
    "delta_rule_step",
    "set_value_checks",
    "RULES",
    "StepRule",
    "get_rule",
    "register_rule",
]
__version__ = "0.1.0"
