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
_POWERS = 2.0**_EXPONENTS  # the smallest |g| of each nonzero bin


def summarize(hist: np.ndarray, amax: np.ndarray, scale: float) -> dict[str, object]:
    """Per-layer fp16 range figures at loss scale ``scale`` (> 0) from ``hist`` (L, BINS),
    ``amax`` (L,).

    Returns ``headroom_bits`` (log2 of fp16 max over the largest scaled gradient), ``underflow``
    (share of nonzero gradients below fp16's smallest normal at this scale), ``safe_lo`` /
    ``safe_hi`` per layer, and ``window``: the scale range ``[lo, hi]`` that keeps
    KEEP_FRACTION of all nonzero gradients normal and the largest below FP16_MAX (``lo > hi``
    means no fp16 scale can hold them). Non-finite amax (an overflowing step) gives NaNs.
    Cost: a fixed handful of numpy calls (one cumulative sum serves every figure).
    """
    hist = np.asarray(hist, dtype=np.float64)
    amax = np.asarray(amax, dtype=np.float64)
    layers = len(amax)
    # cumulative nonzero counts per layer, and for the whole model in the last row
    cum = np.cumsum(hist[:, 1:], axis=1)
    cum = np.vstack((cum, cum.sum(axis=0)))
    total = cum[:, -1]
    safe_lo = _lowest_safe_scale(cum, total)
    # values below FP16_MIN_NORMAL at this scale fill the lowest bins: a prefix of them
    below = int(np.count_nonzero(_POWERS * scale < FP16_MIN_NORMAL))
    lost = cum[:layers, below - 1] if below else np.zeros(layers)
    underflow = np.where(total[:layers] > 0, lost / np.maximum(total[:layers], 1.0), 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        safe_hi = FP16_MAX / amax  # amax 0: inf (no bound)
        safe_hi[~np.isfinite(amax)] = np.nan
        headroom = np.log2(safe_hi / scale)
    return {
        "amax": amax,
        "headroom_bits": headroom,
        "underflow": underflow,
        "safe_lo": safe_lo[:layers],
        "safe_hi": safe_hi,
        "window": (float(safe_lo[-1]), float(np.min(safe_hi)) if layers else math.inf),
    }


def _lowest_safe_scale(cum: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Per row of cumulative nonzero counts, the smallest power-of-two scale keeping
    KEEP_FRACTION of the nonzeros normal in fp16 (NaN for a row without any)."""
    ok = cum <= ((1.0 - KEEP_FRACTION) * total + 1e-9)[:, None]
    # cum never decreases, so ``ok`` is a prefix: e* is the highest exponent still within it
    e_star = E_MIN - 1 + ok.sum(axis=1)
    # values below 2^(e*+1) may underflow: need 2^(e*+1) * S >= 2^-14
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total > 0, 2.0 ** (-15.0 - e_star), np.nan)
