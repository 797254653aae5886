"""``--set MODULE.NAME=VALUE``: a benchmark run sets deltaflow's module-level constants (the
Triton ops' launch settings, switches still under trial) before it times anything, one flag
for all of them instead of a flag per switch. The modules read them at call time, so a value
set before the runs is what the runs use.

MODULE is the last component of one of :data:`MODULES`; NAME an UPPER_CASE constant of it
holding a bool, int, float or str. VALUE is read as that constant's current type: a bool from
0/1/true/false, an int, a float, a str (checked against :data:`CHOICES` where the values are a
fixed set). Anything else is refused with one line naming the item and what was expected, at
the start of the run rather than minutes into it.

    --set conv_norm_triton.BWD_TILES=2,triton_backend.SAVE_FOR_BACKWARD=prepare --set conv.X=1
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

# The modules whose constants may be set, by their last component.
MODULES = {
    path.rsplit(".", 1)[1]: path
    for path in (
        "deltaflow.layers.conv",
        "deltaflow.layers.short_conv_triton",
        "deltaflow.layers.conv_norm_triton",
        "deltaflow.ops.triton_backend",
        "deltaflow.ops.triton.common",  # block floors under trial (issue 32)
        "deltaflow.ops.triton.prepare",  # the kernels' launch settings (issue 32's variants)
        "deltaflow.ops.triton.rebuild",
        "deltaflow.ops.triton.states",
        "deltaflow.ops.triton.dstates",
        "deltaflow.ops.triton.segment_states",
        "deltaflow.ops.triton.segment_chain",
        "deltaflow.ops.triton.outputs",
        "deltaflow.ops.triton.gradients",
        "deltaflow.ops.triton.gradients_lean",
        "deltaflow.models.compile",
        "deltaflow.models.loss",
    )
}
# str constants whose values are a fixed set: their modules check them only when an op runs
# (a run's warm-up, minutes in), so a typo is caught here instead.
CHOICES: dict[str, tuple[str, ...]] = {
    "triton_backend.SAVE_FOR_BACKWARD": ("none", "prepare", "states", "t"),
    "common.FP32_MIN_KEY_BLOCK_WHEN": ("wider_value", "unequal", "narrow"),
    "triton_backend.FORWARD_MODE": ("auto", "fused", "two_pass"),
    "triton_backend.SEQUENCE_PARALLEL_STATES": ("off", "on", "auto"),
    "gradients.GRADS_LEAN": ("off", "on", "auto"),
    "gradients.GRADS_FUSED": ("off", "on", "auto"),
    "segment_chain.SEGMENT_CHAIN": ("triton", "torch"),
    "loss.FUSED_CE_BACKEND": ("auto", "torch", "liger"),
}
# Modules of which only some constants are read at call time: the others are bound at import
# (loss.DEFAULT_CHUNK_SIZE and IGNORE_INDEX are default arguments and modeling.py's imports),
# so setting them would change nothing.
ONLY: dict[str, tuple[str, ...]] = {"loss": ("FUSED_CE_BACKEND",)}
_BOOLS = {"0": False, "1": True, "false": False, "true": True}


class SettingError(ValueError):
    """One ``--set`` item that names no setting or gives it a value of the wrong type."""


def add_settings_arg(p: argparse.ArgumentParser) -> None:
    """``--set``, repeatable, each a comma-separated list of items (read by :func:`parse`)."""
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE[,...]",
        help="set a module constant of deltaflow before the runs (repeatable, comma-separated), "
        "typed as its current value (bool: 0/1/true/false), e.g. conv_norm_triton.BWD_TILES=2,"
        f"triton_backend.SAVE_FOR_BACKWARD=prepare; MODULE one of {', '.join(MODULES)}",
    )


def settable(module: ModuleType) -> dict[str, bool | int | float | str]:
    """The constants of ``module`` that ``--set`` may set, with their current values."""
    only = ONLY.get(module.__name__.rsplit(".", 1)[1])
    return {
        name: value
        for name, value in vars(module).items()
        if name.isupper()
        and not name.startswith("_")
        and type(value) in (bool, int, float, str)
        and (only is None or name in only)
    }


def _value(key: str, current: bool | int | float | str, text: str) -> bool | int | float | str:
    """``text`` as the type of ``current``; SettingError (the expectation) when it is not one."""
    kind = type(current)
    if kind is bool:
        if text.lower() not in _BOOLS:
            raise SettingError(f"a bool (0/1/true/false; now {current})")
        return _BOOLS[text.lower()]
    if kind is str:
        choices = CHOICES.get(key)
        if choices is not None and text not in choices:
            raise SettingError(f"one of {', '.join(choices)} (now {current!r})")
        return text
    try:
        return kind(text)
    except ValueError:
        raise SettingError(f"{'an int' if kind is int else 'a float'} (now {current})") from None


def parse(args: Iterable[str]) -> dict[str, bool | int | float | str]:
    """``MODULE.NAME -> value`` of every item of ``args`` (each comma-separated; a later item
    of the same name wins). Imports the modules named; sets nothing (:func:`apply` does).
    SettingError with one line naming the first bad item and what it should be."""
    settings: dict[str, bool | int | float | str] = {}
    for item in (i.strip() for arg in args for i in arg.split(",")):
        if not item:
            continue
        key, eq, text = item.partition("=")
        module_name, dot, name = key.partition(".")
        if not eq or not dot or not name:
            raise SettingError(f"{item!r} is not MODULE.NAME=VALUE")
        if module_name not in MODULES:
            raise SettingError(f"{item!r}: no module {module_name!r}, expected one of "
                               f"{', '.join(MODULES)}")  # fmt: skip
        constants = settable(importlib.import_module(MODULES[module_name]))
        if name not in constants:
            raise SettingError(f"{item!r}: {module_name} has no setting {name!r}, expected one "
                               f"of {', '.join(sorted(constants))}")  # fmt: skip
        try:
            settings[key] = _value(key, constants[name], text)
        except SettingError as e:
            raise SettingError(f"{item!r}: {name} is {e}, got {text!r}") from None
    return settings


def apply(settings: dict[str, Any]) -> None:
    """Set each ``MODULE.NAME`` of :func:`parse`'s result, process-wide (as a sweep does)."""
    for key, value in settings.items():
        module_name, name = key.split(".", 1)
        setattr(importlib.import_module(MODULES[module_name]), name, value)


@contextlib.contextmanager
def applied(settings: dict[str, Any]) -> Iterator[None]:
    """:func:`apply` for the ``with`` block only: the previous values come back after it (a
    benchmark timing several variants in one process, interleaved)."""
    before = {}
    for key in settings:
        module_name, name = key.split(".", 1)
        before[key] = getattr(importlib.import_module(MODULES[module_name]), name)
    apply(settings)
    try:
        yield
    finally:
        apply(before)
