"""fp8 casts as torchao's float8 training does them, in plain torch (no torchao needed).

A tensor is scaled by ``fp8_max / amax`` (per tensor, or per row for the rowwise recipe, whose
scales are rounded down to a power of two), saturated to the fp8 range and cast. The plan
(:mod:`ampguard.fp8`) and the fp8 telemetry (:mod:`ampguard.fp8._stats`) both measure
through these functions, so what they report is what the cast does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["E4M3", "E5M2", "Recipe", "RECIPES", "quantize", "flushed_share", "sqnr_db"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12  # torchao's floor on amax before dividing


class Recipe(NamedTuple):
    """How one torchao recipe scales: per row or per tensor, power-of-two scales, grad dtype."""

    name: str
    rowwise: bool
    pow2: bool
    grad_dtype: torch.dtype


# torchao 0.18: "tensorwise" casts the output gradient to e5m2; "rowwise" casts everything to
# e4m3 with per-row power-of-two scales.
RECIPES = {
    "tensorwise": Recipe("tensorwise", False, False, E5M2),
    "rowwise": Recipe("rowwise", True, True, E4M3),
}


def quantize(x: torch.Tensor, dtype: torch.dtype, recipe: Recipe) -> torch.Tensor:
    """``x`` (2-D) cast to ``dtype`` under ``recipe``'s scaling and back, in float32.

    Cost: no host sync.
    """
    xf = x.float()
    a = xf.abs()
    amax = a.amax(dim=-1, keepdim=True) if recipe.rowwise else a.amax()
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.clamp(min=_EPS)
    if recipe.pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (xf * scale).clamp(-fmax, fmax).to(dtype)
    return q.float() / scale


def flushed_share(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """Share of ``x``'s nonzero values that are zero in ``xq`` (a 0-d tensor). No host sync."""
    nonzero = x != 0
    flushed = (nonzero & (xq == 0)).sum()
    return flushed.float() / nonzero.sum().clamp(min=1).float()


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Signal-to-quantisation-noise ratio of ``approx`` against ``ref`` in dB (0-d tensor);
    +inf when they are equal. No host sync."""
    ref = ref.double()
    noise = (ref - approx.double()).pow(2).sum()
    return 10 * torch.log10(ref.pow(2).sum() / noise)
