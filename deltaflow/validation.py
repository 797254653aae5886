"""Checks every config section shares: unknown keys with a did-you-mean, and value types.

A misspelt key must never be ignored (``hiden_size: 64`` silently training the default width)
and a YAML string must never pass for a boolean (``"false"`` is truthy in Python), so the
train config, its task and model sections and :class:`~deltaflow.models.DeltaFlowConfig` all
report such values as one-line errors through these helpers.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known key, or an empty string."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_known_keys(where: str, keys: Iterable[str], known: Iterable[str]) -> None:
    """Raise ``ValueError`` naming every key of ``keys`` not in ``known``, each with the
    closest known key; the known keys are listed when none is close."""
    known = sorted(set(known))
    unknown = [k for k in keys if k not in known]
    if not unknown:
        return
    parts = [f"{k!r}{did_you_mean(str(k), known)}" for k in unknown]
    noun = "key" if len(unknown) == 1 else "keys"
    message = f"{where}: unknown {noun} {', '.join(parts)}"
    if not any("did you mean" in p for p in parts):
        message += f"; valid keys: {', '.join(known)}"
    raise ValueError(message)


def describe(value: Any) -> str:
    """``the string 'false'`` / ``3 (int)``: what a wrongly typed value is, for messages."""
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"{value!r} ({type(value).__name__})"


def check_bool(name: str, value: Any) -> bool:
    """A real boolean (YAML ``true``/``false``), never a string or a number."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false (a boolean), got {describe(value)}")
    return value


def check_int(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        none = " or null" if allow_none else ""
        raise TypeError(f"{name} must be an integer{none}, got {describe(value)}")
    return value


def check_float(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """A number (int or float; a numeric string such as YAML 1.1's ``3e-4`` is converted)."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        none = " or null" if allow_none else ""
        raise TypeError(f"{name} must be a number{none}, got {describe(value)}")
    return float(value)


def check_str(name: str, value: Any, *, allow_none: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        none = " or null" if allow_none else ""
        # YAML (config files, --set) reads a bare off/on/no/yes as a bool: say how to quote it
        word = "on" if value else "off"
        hint = (
            f" (YAML reads a bare on/off/yes/no as a bool: quote the word, {name}='{word}')"
            if isinstance(value, bool)
            else ""
        )
        raise TypeError(f"{name} must be a string{none}, got {describe(value)}{hint}")
    return value
