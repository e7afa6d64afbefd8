"""The multi-format part of the plan: per Linear, per format and per tensor role, what the cast
does to the layer, and a verdict in words.

For each format of ``fp8_plan(..., formats=...)`` and each traced Linear, with the layer's input
``x``, weight ``w`` and output gradient ``g`` quantised as the format stores them
(:mod:`ampguard.fp8._formats`):

- ``sqnr_db``: the layer's output ``x @ w.T`` from the quantised input and weight, against the
  bf16 output (as the fp8 plan's figure);
- ``sqnr_loss_db``: how far that falls below the format's *nominal* SQNR, the same figure on
  Gaussian input and weight (what the format costs any layer): 0 for a well-behaved layer, large
  when an outlier or a heavy tail costs this layer more than the format's rounding;
- per role (``input_``, ``weight_``, ``grad_``): ``sqnr_db`` of the tensor itself, ``saturated``
  (share of values above the largest value their scale can hold: clipped), ``flushed`` (share of
  nonzero values that become zero) and ``scale_spread_bits`` (log2 of the largest over the
  smallest scale of the tensor's blocks or rows: how different its blocks are; 0 for one scale).

A format's own rounding flushes some values of any layer (NVFP4's e2m1 about 7% of Gaussian
values, e4m3 almost none): the flushed and saturated limits apply to the share *above* the
format's nominal share on the Gaussian layer (``nominal_input_flushed``, ...), so a limit means
"what this layer loses beyond what the format costs everyone". A format is ``ready`` for a layer
when the shape fits, no such excess crosses the plan's limits and
``sqnr_loss_db <= max_sqnr_loss_db``; ``reason`` names the first limit crossed with its figure.

Cost: per layer and format three quantisations and one small matmul, one host sync per layer
and format; the nominal figures are computed once per format and process.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ampguard.fp8._cast import sqnr_db
from ampguard.fp8._formats import FORMATS, LowpFormat, half_ulp

__all__ = ["measure_formats", "ROLES", "nominal", "nominal_db"]

ROLES = ("input", "weight", "grad")
_NOMINAL_SHAPE = (256, 256, 256)  # rows, in, out of the Gaussian reference layer


def _role_figures(
    x: torch.Tensor, fmt: LowpFormat, role: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the quantised tensor, [sqnr_db, saturated, flushed, scale_spread_bits]) of one tensor;
    0-d tensors, no host sync."""
    xf = x.float()
    q, scale = fmt.quantize(xf, role)
    mags = xf.abs()
    nonzero = mags > 0
    count = nonzero.sum().clamp(min=1).float()
    limit = scale * (_max_value(fmt, role) * (1 + half_ulp(fmt)))
    saturated = (mags > limit).sum().float() / count
    flushed = (nonzero & (q == 0)).sum().float() / count
    err = xf - q
    sqnr = 10 * torch.log10(mags.pow(2).sum() / err.pow(2).sum())
    return q, [sqnr, saturated, flushed, _spread(mags, scale, fmt)]


def _spread(mags: torch.Tensor, scale: torch.Tensor, fmt: LowpFormat) -> torch.Tensor:
    """log2(largest / smallest scale) over the blocks (rows) that hold a nonzero value."""
    if not fmt.block:
        return torch.zeros(())
    width = mags.shape[-1] if fmt.block < 0 else fmt.block
    used = mags.reshape(-1, width).amax(dim=-1) > 0
    first = scale.reshape(-1, width)[:, 0]  # one scale per block (no mask indexing: no sync)
    hi = torch.where(used, first, 0.0).amax()
    lo = torch.where(used, first, torch.inf).amin()
    return torch.where(used.any(), torch.log2(hi / lo), 0.0)


@functools.cache
def _elem_max(element: str) -> float:
    if element == "e2m1":
        return 6.0
    return float(torch.finfo(torch.float8_e5m2 if element == "e5m2" else torch.float8_e4m3fn).max)


def _max_value(fmt: LowpFormat, role: str) -> float:
    return _elem_max(fmt.element(role))


def _measure(
    x: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor | None,
    fmt: LowpFormat,
    ref: torch.Tensor | None = None,
) -> dict[str, float | None]:
    xq, x_figs = _role_figures(x, fmt, "input")
    wq, w_figs = _role_figures(w, fmt, "weight")
    ref = x.float() @ w.float().T if ref is None else ref  # the bf16 output, shared by formats
    figures = [sqnr_db(ref, xq @ wq.T), *x_figs, *w_figs]
    names = ["sqnr_db", *(f"{r}_{k}" for r in ("input", "weight") for k in _ROLE_KEYS)]
    if g is not None:
        figures += _role_figures(g, fmt, "grad")[1]
        names += [f"grad_{k}" for k in _ROLE_KEYS]
    values = torch.stack([f.reshape(()).double() for f in figures]).tolist()  # one sync
    out: dict[str, float | None] = {f"grad_{k}": None for k in _ROLE_KEYS}
    out.update(zip(names, values, strict=True))
    return out


_ROLE_KEYS = ("sqnr_db", "saturated", "flushed", "scale_spread_bits")


@functools.cache
def nominal(name: str) -> dict[str, float | None]:
    """The format's figures on a Gaussian layer (what its rounding costs any layer); cached."""
    rows, fin, fout = _NOMINAL_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, fin, generator=gen).to(torch.bfloat16)
    w = (torch.randn(fout, fin, generator=gen) / fin**0.5).to(torch.bfloat16)
    g = (torch.randn(rows, fout, generator=gen) * 1e-3).to(torch.bfloat16)
    with torch.no_grad():
        return _measure(x, w, g, FORMATS[name])


def nominal_db(name: str) -> float:
    """The format's output SQNR on a Gaussian layer."""
    value = nominal(name)["sqnr_db"]
    assert value is not None
    return value


def measure_formats(
    shape: tuple[int, int],
    x: torch.Tensor | None,
    w: torch.Tensor,
    g: torch.Tensor | None,
    formats: tuple[str, ...],
    th: Any,
) -> dict[str, dict[str, Any]]:
    """Per format: the figures above, ``eligible``, ``ready`` and ``reason``."""
    out: dict[str, dict[str, Any]] = {}
    ref = None if x is None else x.float() @ w.float().T
    for name in formats:
        fmt = FORMATS[name]
        info: dict[str, Any] = {"ready": False, "eligible": fmt.shape_ok(*shape)}
        if not info["eligible"]:
            info["reason"] = (
                f"shape {shape[0]}x{shape[1]}: {name} needs in and out features that are "
                f"multiples of {fmt.multiple}"
            )
        elif x is None:
            info["reason"] = "not called in the traced forward: nothing to measure"
        else:
            with torch.no_grad():
                info.update(_measure(x, w, g, fmt, ref))
            base = nominal(name)
            info["nominal_db"] = base["sqnr_db"]
            info["sqnr_loss_db"] = info["nominal_db"] - info["sqnr_db"]
            for key in _LIMITED:
                info[f"nominal_{key}"] = base[key]
            problem = _problem(info, fmt, th)
            info["ready"] = problem is None
            info["reason"] = _reason(info, fmt, th, problem)
        out[name] = info
    return out


_LIMITED = tuple(f"{r}_{k}" for k in ("flushed", "saturated") for r in ROLES)


def _limit(key: str, th: Any) -> float:
    return float(th.max_saturated if key.endswith("saturated") else getattr(th, f"max_{key}"))


def _problem(info: dict[str, Any], fmt: LowpFormat, th: Any) -> str | None:
    for key in _LIMITED:
        value = info.get(key)
        if value is not None and value - (info.get(f"nominal_{key}") or 0.0) > _limit(key, th):
            return key
    if not info["sqnr_loss_db"] <= th.max_sqnr_loss_db:  # NaN (an all-zero output) fails
        return "sqnr_loss_db"
    return None


def _reason(info: dict[str, Any], fmt: LowpFormat, th: Any, problem: str | None) -> str:
    sq = f"SQNR {info['sqnr_db']:.1f} dB ({info['sqnr_loss_db']:+.1f} dB from {fmt.name}'s nominal)"
    if problem is None:
        return f"{sq}; flushed {_pct(info['input_flushed'])} of the input"
    if problem == "sqnr_loss_db":
        return (
            f"{sq}: loses more than {th.max_sqnr_loss_db:g} dB to this layer's value "
            f"distribution (input scale spread {info['input_scale_spread_bits']:.1f} bits)"
        )
    role, what = problem.split("_", 1)
    verb = (
        "saturates (clipped at its scale's largest value)"
        if what == "saturated"
        else ("flushes to zero")
    )
    base = info.get(f"nominal_{problem}") or 0.0
    return (
        f"{_pct(info[problem])} of the {'output gradient' if role == 'grad' else role} {verb} "
        f"in {fmt.element(role)} ({_pct(base)} on a Gaussian layer; limit "
        f"{_pct(_limit(problem, th))} more)"
    )


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.2%}"
