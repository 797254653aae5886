"""deltaflow: delta-rule linear attention with one recurrence and a table of step rules.

The design (recurrence, chunked algorithm, backward): docs/design.md. The public op is
:func:`delta_rule`; step rules live in :mod:`deltaflow.rules`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562), so that `deltaflow --help` and every light command start
# without torch (seconds on a loaded machine): name -> module.
_LAZY = {
    "delta_rule": "deltaflow.ops",
    "delta_rule_step": "deltaflow.ops",
    "RULES": "deltaflow.rules",
    "StepRule": "deltaflow.rules",
    "get_rule": "deltaflow.rules",
    "register_rule": "deltaflow.rules",
}


def lazy_attribute(package: str, exports: dict[str, str], name: str) -> Any:
    """``exports[name]``'s attribute ``name``, imported now and cached in ``package``."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    setattr(importlib.import_module(package), name, value)
    return value


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)


__all__ = [
    "delta_rule",
    "delta_rule_step",
    "RULES",
    "StepRule",
    "get_rule",
    "register_rule",
]
__version__ = "0.1.0"
