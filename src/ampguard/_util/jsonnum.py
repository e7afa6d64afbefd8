"""JSON has no NaN or infinity: where ampguard writes a number that may be non-finite, it writes
``null`` (runlog's ``num``/``floats`` also round to 7 significant digits)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite_or_none"]


def finite_or_none(value: Any) -> Any:
    """``None`` for a non-finite float, ``value`` unchanged otherwise."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
