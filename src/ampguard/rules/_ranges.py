"""fp16 range arithmetic on the host: headroom, underflow and the safe loss-scale window.

Telemetry records, per layer, the largest |unscaled gradient| and a histogram of the base-2
exponents of the unscaled gradients (bin 0 holds exact zeros; bin ``k >= 1`` holds values with
``floor(log2|g|) == E_MIN + k - 1``, clamped into ``[E_MIN, E_MAX]``). Everything here turns those
into what fp16 would do at a loss scale ``S`` (numpy only, no torch, no device).
"""

from __future__ import annotations

import math

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

_EXPONENTS = np.arange(E_MIN, E_MAX + 1, dtype=np.float64)  # exponent of bins 1..BINS-1


def _underflow(hist: np.ndarray, scale: float) -> np.ndarray:
    """Share of nonzero values per row with ``|g| * scale < FP16_MIN_NORMAL`` (exact for 2^k)."""
    nonzero = hist[:, 1:]
    below = (2.0**_EXPONENTS) * scale < FP16_MIN_NORMAL
    total = nonzero.sum(axis=1)
    lost = nonzero[:, below].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, lost / np.maximum(total, 1), 0.0)


def _lowest_safe_scale(hist: np.ndarray) -> np.ndarray:
    """Per row, the smallest power-of-two scale keeping KEEP_FRACTION of nonzeros normal in fp16."""
    nonzero = hist[:, 1:]
    total = nonzero.sum(axis=1)
    allowed = (1.0 - KEEP_FRACTION) * total
    cum = np.cumsum(nonzero, axis=1)
    ok = cum <= allowed[:, None] + 1e-9
    # cum never decreases, so ``ok`` is a prefix: e* is the highest exponent still within it
    e_star = (E_MIN - 1 + ok.sum(axis=1)).astype(np.float64)
    # values below 2^(e*+1) may underflow: need 2^(e*+1) * S >= 2^-14
    lo = 2.0 ** (-14.0 - (e_star + 1.0))
    return np.where(total > 0, lo, np.nan)


def summarize(hist: np.ndarray, amax: np.ndarray, scale: float) -> dict[str, object]:
    """Per-layer fp16 range figures at loss scale ``scale`` from ``hist`` (L, BINS), ``amax`` (L,).

    Returns ``headroom_bits`` (log2 of fp16 max over the largest scaled gradient), ``underflow``
    (share of nonzero gradients below fp16's smallest normal at this scale), ``safe_lo`` /
    ``safe_hi`` per layer, and ``window``: the scale range ``[lo, hi]`` that keeps
    KEEP_FRACTION of all nonzero gradients normal and the largest below FP16_MAX (``lo > hi``
    means no fp16 scale can hold them). Non-finite amax (an overflowing step) gives NaNs.
    """
    hist = np.asarray(hist, dtype=np.float64)
    amax = np.asarray(amax, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        finite = np.isfinite(amax)
        safe_hi = np.where(finite & (amax > 0), FP16_MAX / np.where(amax > 0, amax, 1.0), np.inf)
        safe_hi = np.where(finite, safe_hi, np.nan)
        scaled = amax * scale
        headroom = np.where(
            scaled > 0, np.log2(FP16_MAX / np.where(scaled > 0, scaled, 1.0)), np.inf
        )
        headroom = np.where(finite, headroom, np.nan)
    safe_lo = _lowest_safe_scale(hist)
    underflow = _underflow(hist, scale)
    total = hist.sum(axis=0, keepdims=True)
    glo = float(_lowest_safe_scale(total)[0])
    ghi = float(np.min(safe_hi)) if safe_hi.size else math.inf
    return {
        "amax": amax,
        "headroom_bits": headroom,
        "underflow": underflow,
        "safe_lo": safe_lo,
        "safe_hi": safe_hi,
        "window": (glo, ghi),
    }
