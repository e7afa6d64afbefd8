"""fp16 range arithmetic on the host: headroom, underflow and the safe loss-scale window.

Telemetry records, per layer, the largest |unscaled gradient| and a histogram of the base-2
exponents of the unscaled gradients (bin 0 holds exact zeros; bin ``k >= 1`` holds values with
``floor(log2|g|) == E_MIN + k - 1``, clamped into ``[E_MIN, E_MAX]``). Everything here turns those
into what fp16 would do at a loss scale ``S`` (plain Python, no torch, no device).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from itertools import accumulate
from typing import Any

import numpy as np

__all__ = [
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "E_MIN",
    "E_MAX",
    "BINS",
    "KEEP_FRACTION",
    "summarize",
]

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
E_MIN = -60  # exponents below this share the lowest bin (they underflow at any usable scale)
E_MAX = 15  # exponents above this share the highest bin (the exact amax is recorded separately)
BINS = E_MAX - E_MIN + 2  # + bin 0 for exact zeros
KEEP_FRACTION = 0.999  # the safe window keeps this share of nonzero gradients above FP16_MIN_NORMAL

_POWERS = [2.0**e for e in range(E_MIN, E_MAX + 1)]  # the smallest |g| of each nonzero bin


def summarize(hist: Any, amax: Any, scale: float) -> dict[str, Any]:
    """Per-layer fp16 range figures at loss scale ``scale`` (> 0) from ``hist`` (L rows of BINS
    counts) and ``amax`` (L values), as arrays or lists.

    Returns lists: ``headroom_bits`` (log2 of fp16 max over the largest scaled gradient),
    ``underflow`` (share of nonzero gradients below fp16's smallest normal at this scale),
    ``safe_lo`` / ``safe_hi`` per layer, ``amax``, and ``window``: the scale range ``[lo, hi]``
    that keeps KEEP_FRACTION of all nonzero gradients normal and the largest below FP16_MAX
    (``lo > hi`` means no fp16 scale can hold them). Non-finite amax (an overflowing step) gives
    NaNs. Cost: plain Python, one pass over the histogram (telemetry's flush calls it once per
    range sample; per call, numpy's fixed costs exceed this arithmetic at any layer count).
    """
    rows = hist.tolist() if isinstance(hist, np.ndarray) else [list(row) for row in hist]
    peaks = amax.tolist() if isinstance(amax, np.ndarray) else list(amax)
    # cumulative nonzero counts per layer; values below FP16_MIN_NORMAL at this scale fill the
    # lowest bins, a prefix of them
    cums = [list(accumulate(row[1:])) for row in rows]
    below = 0
    for power in _POWERS:
        if not power * scale < FP16_MIN_NORMAL:
            break
        below += 1
    underflow = [
        cum[below - 1] / max(cum[-1], 1.0) if below and cum[-1] > 0 else 0.0 for cum in cums
    ]
    safe_hi = [_safe_hi(peak) for peak in peaks]
    model = [sum(column) for column in zip(*cums, strict=True)]  # the whole model's counts
    return {
        "amax": [float(peak) for peak in peaks],
        "headroom_bits": [_log2(hi / scale) for hi in safe_hi],
        "underflow": underflow,
        "safe_lo": [_lowest_safe_scale(cum) for cum in cums],
        "safe_hi": safe_hi,
        "window": (
            _lowest_safe_scale(model) if rows else math.nan,
            (math.nan if any(hi != hi for hi in safe_hi) else min(safe_hi))
            if safe_hi
            else math.inf,
        ),
    }


def _safe_hi(peak: float) -> float:
    """The largest scale keeping ``peak`` below FP16_MAX (inf for 0, NaN when non-finite)."""
    if not math.isfinite(peak):
        return math.nan
    return FP16_MAX / peak if peak > 0 else math.inf


def _log2(x: float) -> float:
    return math.log2(x) if x > 0 or x != x else -math.inf


def _lowest_safe_scale(cum: list[float]) -> float:
    """From one row of cumulative nonzero counts: the smallest power-of-two scale keeping
    KEEP_FRACTION of the nonzeros normal in fp16 (NaN for a row without any)."""
    total = cum[-1]
    if not total > 0:
        return math.nan
    # cum never decreases, so the bins within the allowance are a prefix: e* is the highest
    # exponent still within it; values below 2^(e*+1) may underflow: need 2^(e*+1) * S >= 2^-14
    e_star = E_MIN - 1 + bisect_right(cum, (1.0 - KEEP_FRACTION) * total + 1e-9)
    return 2.0 ** (-15.0 - e_star)
