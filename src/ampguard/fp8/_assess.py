"""The fp8 plan's own verdict per Linear: ready or not in the plan's recipe, the first limit
crossed, the reason in words and the fix (``fine``, ``keep_bf16``, ``rowwise``, ``rescale``).

The figures are the recipe's format figures (:class:`ampguard.fp8._multi.LayerMeasure`; the
``tensorwise`` and ``rowwise`` formats are torchao's recipes), so a plan measured with
``formats=`` including its recipe computes them once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampguard.fp8._cast import Recipe
from ampguard.fp8._multi import LayerMeasure

__all__ = ["assess", "MULTIPLE"]

MULTIPLE = 16  # torch._scaled_mm: both matmul dimensions must be multiples of 16
_BASE = ("sqnr_db", "input_flushed", "weight_flushed", "grad_flushed")


def _figures(layer: LayerMeasure, rec: Recipe) -> dict[str, Any]:
    figs = layer.figures(rec.name)
    return {k: figs[k] for k in _BASE}


def assess(
    mod: nn.Linear,
    layer: LayerMeasure | None,
    rec: Recipe,
    alt: Recipe | None,
    th: Any,
) -> dict[str, Any]:
    """The layer's ``layers[name]`` entry of :class:`ampguard.Fp8Plan` (``layer`` None: not
    called in the traced forward). Cost: the recipe's figures (one host sync), one more for the
    input's amax and median, and the alternative recipe's figures when they could fix it."""
    shape = (mod.in_features, mod.out_features)
    eligible = all(d % MULTIPLE == 0 and d > 0 for d in shape)
    info: dict[str, Any] = {
        "ready": False,
        "reason": "",
        "fix": "keep_bf16",
        "problem": "unused",
        "eligible": eligible,
        "shape": shape,
        "sqnr_db": None,
        "input_flushed": None,
        "weight_flushed": None,
        "grad_flushed": None,
        "input_amax": None,
        "input_outlier_ratio": None,
        "grad_amax": None,
    }
    if layer is None:
        info["reason"] = "not called in the traced forward: nothing to measure, kept in bf16"
        return info
    info.update(_figures(layer, rec))
    with torch.no_grad():
        gamax = layer.g.amax if layer.g is not None else layer.x.amax.new_zeros(())
        amax, median, grad_amax = torch.stack(
            [layer.x.amax, layer.x.median_nonzero, gamax]
        ).tolist()
    info["input_amax"] = amax
    info["input_outlier_ratio"] = amax / median if median > 0 else None  # NaN: no nonzero
    info["grad_amax"] = None if layer.g is None else grad_amax
    problem = _problem(info, th)
    alt_ok = (
        alt is not None
        and problem in ("input", "weight", "sqnr")
        and _problem({**info, **_figures(layer, alt)}, th) is None
    )
    info["reason"], info["fix"] = _verdict(info, problem, alt_ok, rec, th)
    info["ready"], info["problem"] = problem is None, problem
    return info


def _problem(info: dict[str, Any], th: Any) -> str | None:
    """The first limit the layer crosses, or None when it is ready."""
    if not info["eligible"]:
        return "shape"
    if info["input_flushed"] > th.max_input_flushed:
        return "input"
    if info["weight_flushed"] > th.max_weight_flushed:
        return "weight"
    if info["grad_flushed"] is not None and info["grad_flushed"] > th.max_grad_flushed:
        return "grad"
    if not info["sqnr_db"] >= th.min_sqnr_db:  # NaN (an all-zero output) is not ready
        return "sqnr"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return "e5m2" if dtype == torch.float8_e5m2 else "e4m3"


def _verdict(
    info: dict[str, Any], problem: str | None, alt_ok: bool, rec: Recipe, th: Any
) -> tuple[str, str]:
    """(one-line reason, fix) for a measured layer."""
    i, o = info["shape"]
    sq = f"SQNR {info['sqnr_db']:.1f} dB"
    if problem is None:
        grad = "-" if info["grad_flushed"] is None else f"{info['grad_flushed']:.2%}"
        return (
            f"{sq}; flushed: input {info['input_flushed']:.2%}, weight "
            f"{info['weight_flushed']:.2%}, gradient {grad}",
            "fine",
        )
    then = "rowwise" if alt_ok else "keep_bf16"
    if problem == "shape":
        return (
            f"shape {i}x{o}: fp8 matmuls need in and out features that are multiples of {MULTIPLE}",
            "keep_bf16",
        )
    if problem == "input":
        ratio = info["input_outlier_ratio"]
        why = f" (input amax {ratio:.3g}x its median: outlier features)" if ratio else ""
        return (
            f"{info['input_flushed']:.2%} of the input flushes to zero in e4m3 "
            f"(limit {th.max_input_flushed:.2%}){why}",
            then,
        )
    if problem == "weight":
        return (
            f"{info['weight_flushed']:.2%} of the weight flushes to zero in e4m3 "
            f"(limit {th.max_weight_flushed:.2%})",
            then,
        )
    if problem == "grad":
        return (
            f"{info['grad_flushed']:.2%} of the output gradient flushes to zero in "
            f"{_dtype_name(rec.grad_dtype)} (limit {th.max_grad_flushed:.2%}): it spans "
            "more than fp8's window under one scale",
            "rescale",
        )
    return f"{sq} below the {th.min_sqnr_db:g} dB limit", then
