"""Argument validators shared by every public entry point: one message per kind of mistake.

``check_int`` -> ``ValueError("<name> must be [None or ]an integer >= N, got <repr>")``,
``check_bool`` -> ``TypeError("<name> must be True or False, got <repr>")``,
``check_finite`` -> ``ValueError("<name> must be [None or ]a finite number[ > 0], got <repr>")``.
``bool`` is never an integer or a number here (``True`` is not a step count).
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

__all__ = ["is_int", "is_number", "check_int", "check_bool", "check_finite"]


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int = 1, *, optional: bool = False) -> Any:
    """``value`` when it is an integer >= ``minimum`` (or None, when ``optional``)."""
    if optional and value is None:
        return value
    if not is_int(value) or value < minimum:
        either = "None or " if optional else ""
        raise ValueError(f"{name} must be {either}an integer >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_finite(name: str, value: Any, *, positive: bool = False, optional: bool = False) -> Any:
    """``value`` when it is a finite number (> 0 when ``positive``; or None, when ``optional``)."""
    if optional and value is None:
        return value
    if not (is_number(value) and math.isfinite(value) and (value > 0 or not positive)):
        either = "None or " if optional else ""
        raise ValueError(
            f"{name} must be {either}a finite number{' > 0' if positive else ''}, got {value!r}"
        )
    return value
