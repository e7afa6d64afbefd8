"""Thinning long series for plotting: a figure is ~900 pixels wide, a run can be 10^6 steps.

Drawing every point costs time and memory and shows nothing more, so the plots draw at most
:data:`MAX_POINTS` points per series: a step-wise series keeps only the points where it changes
(exact); anything longer becomes a per-bucket min/max envelope with its mean, which keeps every
spike visible. Also: :func:`plain_text` stops matplotlib reading ``$...$`` in a user's layer name
as math.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "MAX_POINTS",
    "MAX_MARKERS",
    "Envelope",
    "changes",
    "envelope",
    "pick",
    "bucket_columns",
    "plain_text",
]

MAX_POINTS = 4000
MAX_MARKERS = 2000


class Envelope(NamedTuple):
    """Per-bucket first x, min, max and mean of y (NaN where a bucket holds no finite y)."""

    x: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    mean: np.ndarray


def plain_text(text: object) -> str:
    """``text`` shown verbatim by matplotlib: a ``$`` is escaped so no math text is parsed."""
    return str(text).replace("$", r"\$")


def changes(y: np.ndarray) -> np.ndarray:
    """Indices where a step-wise series changes value, plus its first and last point."""
    if len(y) == 0:
        return np.zeros(0, dtype=np.int64)
    a, b = y[1:], y[:-1]
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    keep = np.flatnonzero(np.r_[True, ~same])
    return keep if keep[-1] == len(y) - 1 else np.r_[keep, len(y) - 1]


def _starts(n: int, buckets: int) -> np.ndarray:
    return np.unique(np.linspace(0, n, num=min(n, buckets), endpoint=False).astype(np.int64))


def envelope(x: np.ndarray, y: np.ndarray, buckets: int = MAX_POINTS) -> Envelope:
    """Min, max and mean of ``y`` over ``buckets`` consecutive runs of points (NaN ignored)."""
    if len(y) == 0:
        empty = np.zeros(0)
        return Envelope(empty, empty, empty, empty)
    starts = _starts(len(y), buckets)
    finite = np.isfinite(y)
    with np.errstate(invalid="ignore"):
        lo = np.fmin.reduceat(np.where(finite, y, np.nan), starts)
        hi = np.fmax.reduceat(np.where(finite, y, np.nan), starts)
        counts = np.add.reduceat(finite.astype(np.float64), starts)
        sums = np.add.reduceat(np.where(finite, y, 0.0), starts)
        mean = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return Envelope(x[starts], lo, hi, mean)


def pick(indices: np.ndarray, limit: int = MAX_MARKERS) -> np.ndarray:
    """At most ``limit`` of ``indices``, evenly spread (markers for skipped steps and so on)."""
    if len(indices) <= limit:
        return indices
    return indices[np.linspace(0, len(indices) - 1, num=limit).astype(np.int64)]


def bucket_columns(
    x: np.ndarray, data: np.ndarray, buckets: int = MAX_POINTS // 2
) -> tuple[np.ndarray, np.ndarray]:
    """Columns of ``data`` (rows x samples) averaged over buckets of samples, NaN ignored;
    returns the bucket's first x and the reduced matrix."""
    if data.shape[1] <= buckets:
        return x, data
    starts = _starts(data.shape[1], buckets)
    finite = np.isfinite(data)
    sums = np.add.reduceat(np.where(finite, data, 0.0), starts, axis=1)
    counts = np.add.reduceat(finite.astype(np.float64), starts, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return x[starts], np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
