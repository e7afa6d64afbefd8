"""Numbers in the run log: 7 significant digits, ``null`` where a value is not finite."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["floats", "num", "number_texts"]


def num(value: Any) -> float | None:
    """A JSON-safe float (7 significant digits) or ``None`` for non-finite values."""
    x = float(value)
    return float(f"{x:.7g}") if math.isfinite(x) else None


def floats(values: Any) -> list[float | None]:
    """A JSON-safe list of floats (7 significant digits, ``None`` for non-finite)."""
    isfinite = math.isfinite
    return [
        float(f"{x:.7g}") if isfinite(x) else None
        for x in np.asarray(values, dtype=np.float64).ravel().tolist()
    ]


def number_texts(values: Any) -> list[str]:
    """The JSON text :func:`num` gives each value (``"null"`` for non-finite ones), without
    building a float or a dict per value: the run-log writer formats whole columns with it
    (a value that repeats, such as the loss scale, is formatted once)."""
    known: dict[float, str] = {}
    out = []
    if isinstance(values, np.ndarray):
        values = values.ravel().tolist()
    elif not isinstance(values, list):
        values = np.asarray(values, dtype=np.float64).ravel().tolist()
    for x in values:
        text = known.get(x)
        if text is None:
            if x - x == 0.0:  # finite
                text = f"{x:.7g}"
                if "." not in text and "e" not in text:
                    text += ".0"
            else:  # NaN never matches itself in ``known``; inf is cached like any value
                text = "null"
            known[x] = text
        out.append(text)
    return out
