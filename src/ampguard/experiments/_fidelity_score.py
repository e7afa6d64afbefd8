"""The fidelity meter read as one score that ranks recipes by the final-loss gap they will end at.

:func:`fidelity_score` of a meter reading (:func:`ampguard.fp8.gradient_fidelity`) is the worst
layer's *direction error* plus the share of input features the recipe's forward loses:

    score = max over layers of tan^2(angle between the layer's gradient and bf16's)
            + sum over layers of lost_inputs

Why the angle, and why the worst layer (measured on ``benchmarks/bench_recipe.py``'s outlier MLP,
docs/fp8.md):

- **AdamW takes the gradient's scale out.** Each parameter's step is ``m / sqrt(v)``: a layer's
  gradient shrunk to a sixteenth (the NVFP4 weight gradient of a layer whose batch has a 300x row
  outlier keeps only the outlier rows) moves its weights as far as before, in a direction that
  keeps ``cos`` of the true one. ``tan^2 = (1 - cos^2) / cos^2`` is the energy of the step's
  wrong component over its right one: the layer's noise-to-signal ratio after the optimizer's
  normalisation. The relative error ``|g - g_bf16| / |g_bf16|`` (the summed score's unit) mixes
  the harmless loss of scale into it.
- **Error spread over the layers is absorbed; a layer that cannot learn is not.** The searched
  recipe reads cosine 0.93-0.95 in every layer (tan^2 0.10-0.15; its gradient error 10-17% of
  bf16's own sampling noise) and ends 0.003 above bf16 (6 seeds); ``l1`` alone in NVFP4 reads
  cosine 0.46 in one layer (tan^2 3.6; its error as large as the sampling noise) and 0.99-1.0
  in the others, and ends 0.036 above. The summed squared relative error reads them 0.68 and
  0.82, and puts the spread one above ``l2`` alone in NVFP4 (0.39; ends 0.018 above, its damage
  in the forward). Spread, small error acts as extra minibatch noise, which training averages
  out; a layer whose step is mostly noise learns little, and what is computed through it is
  bounded by it.
- **Lost input features** (``lost_inputs``: features whose forward values the format all but
  loses, next to a massive feature) are damage to the forward that no weight gradient shows;
  their share is added as it is (like tan^2, a ratio of lost signal: to what the layer reads).

Not a calibrated loss delta: a rank order. Pure Python on the reading's numbers: no host sync,
no pass. 0 for an empty reading; a NaN figure gives NaN; a layer whose gradient is orthogonal or
opposite to bf16's (cosine <= 0) gives ``inf``.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["direction_error", "fidelity_score"]


def direction_error(cosine: float) -> float:
    """``tan^2`` of the angle whose cosine is ``cosine``: the optimizer step's wrong component's
    energy over its right one's (0 at cosine 1; ``inf`` at cosine <= 0; NaN stays NaN)."""
    if math.isnan(cosine):
        return math.nan
    if cosine <= 0.0:
        return math.inf
    c2 = min(cosine, 1.0) ** 2
    return (1.0 - c2) / c2


def fidelity_score(meter: dict[str, dict[str, Any]]) -> float:
    """The worst layer's :func:`direction_error` plus the sum of ``lost_inputs`` over the
    reading's layers (module docstring); higher ranks a recipe as ending further above bf16.
    Every layer counts, a bf16 one too (its gradient carries what the low-precision layers
    after it in the backward cost it). Cost: none (the reading's numbers)."""
    if not meter:
        return 0.0
    worst = 0.0
    lost = 0.0
    for m in meter.values():
        d = direction_error(float(m["cosine"]))
        gone = float(m.get("lost_inputs", 0.0))
        if math.isnan(d) or math.isnan(gone):
            return math.nan
        worst = max(worst, d)
        lost += gone
    return worst + lost
