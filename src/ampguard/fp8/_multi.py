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
format's nominal share on the Gaussian layer (``nominal_input_flushed``, ...) plus a margin of
that nominal again (``nominal_margin``: identical layers flush 3-11.5% in NVFP4 against a
nominal 6.8%), so a limit means "what this layer loses beyond what the format costs everyone",
and identical layers get the same verdict. A format is ``ready`` for a layer when the shape fits,
no such excess crosses the plan's limits and ``sqnr_loss_db <= max_sqnr_loss_db``; ``reason`` names
the first limit crossed with its figure.

Every figure is measured from the format's exact cast (:mod:`ampguard.fp8._quant`, bitwise
torchao's), on the rows :mod:`ampguard.fp8._operand` samples (the same for every format).
Cost: per layer and format three casts and one small matmul, one host sync per layer and
format (:class:`LayerMeasure`); the nominal figures are computed once per format and process.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ampguard.fp8._formats import FORMATS, LowpFormat, half_ulp
from ampguard.fp8._operand import Operand, nonzero_count
from ampguard.fp8._quant import CASTS, ELEMENTS, Cast

__all__ = ["measure_formats", "LayerMeasure", "ROLES", "nominal", "nominal_db"]

ROLES = ("input", "weight", "grad")
_ROLE_KEYS = ("sqnr_db", "saturated", "flushed", "scale_spread_bits")
_NOMINAL_SHAPE = (256, 256, 256)  # rows, in, out of the Gaussian reference layer


class _Role:
    """One tensor's figures in one format: device tensors to read in the layer's one sync."""

    def __init__(self, op: Operand, fmt: LowpFormat, role: str) -> None:
        self.op = op
        self.cast = cast = CASTS[fmt.name](op, role)
        buf = op.scratch(1)
        err = torch.sub(op.x, cast.q, out=buf).reshape(-1)
        noise = torch.dot(err, err)
        kept = nonzero_count(cast.q, buf)  # after the dot: buf is reused
        # a value above its scale's largest value (plus half an ulp) is clipped: count the
        # blocks whose amax is, and count their values only when there are any (rare)
        self.limit = cast.scale * (ELEMENTS[fmt.element(role)].max * (1 + half_ulp(fmt)))
        over = (cast.amax > self.limit).sum()
        zero = op.power.new_zeros(())
        hi, lo = _scale_range(cast) if fmt.block else (zero, zero)
        # a zero stays zero in every cast: the flushed values are the nonzero ones lost
        self.values = [op.power, noise, hi, lo, op.nonzero, kept, over]

    def figures(self, values: list[float]) -> dict[str, float]:
        """The role's figures from its synced :attr:`values` (an all-zero tensor flushes
        nothing; its NVFP4 cast is NaN, as torchao's is)."""
        power, noise, hi, lo, *counts = values
        nonzero, kept, over = (round(c) if math.isfinite(c) else 0 for c in counts)
        return {
            "sqnr_db": _db(power, noise),
            "saturated": self._saturated() / nonzero if over and nonzero else 0.0,
            "flushed": (nonzero - kept) / nonzero if nonzero else 0.0,
            "scale_spread_bits": math.log2(hi / lo) if hi > 0 else 0.0,
        }

    def _saturated(self) -> int:
        """Values above the limit, counted one by one (one pass and a host sync)."""
        a = self.op.abs
        if self.limit.dim() == 3:
            a = a.view(self.op.rows, self.limit.shape[1], -1)
        return int((a > self.limit).sum())


def _scale_range(cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest and smallest scale over the blocks (rows) that hold a nonzero value
    (0 and inf when none does)."""
    used = cast.amax > 0  # scale and amax have one entry per block (row)
    return (cast.scale * used).amax(), torch.where(used, cast.scale, math.inf).amin()


def _db(signal: float, noise: float) -> float:
    """``10 * log10(signal / noise)`` with torch's answers at 0 and NaN."""
    if math.isnan(signal) or math.isnan(noise) or (signal == 0 and noise == 0):
        return math.nan
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / noise)


class LayerMeasure:
    """A Linear's traced input ``x``, weight ``w`` and output gradient ``g`` (bf16, 2-D, rows
    sampled by :func:`ampguard.fp8._operand.sample_rows`), measured in any format on demand.

    The float32 values and the statistics every format shares are computed once
    (:class:`~ampguard.fp8._operand.Operand`), as is the bf16 output ``x @ w.T``; the figures of
    a format are computed once and shared by the fp8 plan's own verdict and by ``formats=``.
    Cost of :meth:`figures`: per format three casts, one matmul, one host sync (two when a block
    saturates).
    """

    def __init__(self, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor | None) -> None:
        self.x, self.w = Operand(x), Operand(w)
        self.g = None if g is None else Operand(g)
        self._figures: dict[str, dict[str, float | None]] = {}

    @functools.cached_property
    def ref(self) -> torch.Tensor:
        """The layer's output (no bias) from the bf16 input and weight, in float32."""
        return self.x.x @ self.w.x.T

    @functools.cached_property
    def ref_power(self) -> torch.Tensor:
        flat = self.ref.reshape(-1)
        return torch.dot(flat, flat)

    def figures(self, name: str) -> dict[str, float | None]:
        """``sqnr_db`` (the output's) and per role ``sqnr_db``, ``saturated``, ``flushed``,
        ``scale_spread_bits`` in format ``name`` (grad figures None without a gradient)."""
        if name not in self._figures:
            with torch.no_grad():
                self._figures[name] = self._measure(FORMATS[name])
        return dict(self._figures[name])

    def _measure(self, fmt: LowpFormat) -> dict[str, float | None]:
        roles = [_Role(self.x, fmt, "input"), _Role(self.w, fmt, "weight")]
        if self.g is not None:
            roles.append(_Role(self.g, fmt, "grad"))
        xq, wq = roles[0].cast.q, roles[1].cast.q
        noise = torch.addmm(self.ref, xq, wq.T, alpha=-1).reshape(-1)  # bf16 out - format out
        parts = [self.ref_power, torch.dot(noise, noise)] + [v for r in roles for v in r.values]
        values = torch.stack(parts).tolist()  # the one host sync (stack promotes the counts)
        out: dict[str, float | None] = {f"grad_{k}": None for k in _ROLE_KEYS}
        out["sqnr_db"] = _db(values[0], values[1])
        n = len(roles[0].values)
        for i, (r, role) in enumerate(zip(roles, ROLES, strict=False)):
            figs = r.figures(values[2 + n * i : 2 + n * (i + 1)])
            out.update({f"{role}_{k}": v for k, v in figs.items()})
        return out


@functools.cache
def nominal(name: str) -> dict[str, float | None]:
    """The format's figures on a Gaussian layer (what its rounding costs any layer); cached."""
    rows, fin, fout = _NOMINAL_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, fin, generator=gen).to(torch.bfloat16)
    w = (torch.randn(fout, fin, generator=gen) / fin**0.5).to(torch.bfloat16)
    g = (torch.randn(rows, fout, generator=gen) * 1e-3).to(torch.bfloat16)
    return LayerMeasure(x, w, g).figures(name)


def nominal_db(name: str) -> float:
    """The format's output SQNR on a Gaussian layer."""
    value = nominal(name)["sqnr_db"]
    assert value is not None
    return value


def measure_formats(
    shape: tuple[int, int],
    layer: LayerMeasure | None,
    formats: tuple[str, ...],
    th: Any,
) -> dict[str, dict[str, Any]]:
    """Per format: the figures above, ``eligible``, ``ready`` and ``reason`` (``layer`` None:
    the Linear was not called in the traced forward)."""
    out: dict[str, dict[str, Any]] = {}
    for name in formats:
        fmt = FORMATS[name]
        info: dict[str, Any] = {"ready": False, "eligible": fmt.shape_ok(*shape)}
        if not info["eligible"]:
            info["reason"] = (
                f"shape {shape[0]}x{shape[1]}: {name} needs in and out features that are "
                f"multiples of {fmt.multiple}"
            )
        elif layer is None:
            info["reason"] = "not called in the traced forward: nothing to measure"
        else:
            info.update(layer.figures(name))
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


def _excess(value: float, base: float, th: Any) -> float:
    """How far a share lies beyond what the format costs a layer like this one: its Gaussian
    nominal plus ``nominal_margin`` of it (the spread between layers of the same statistics)."""
    return value - base * (1.0 + th.nominal_margin)


def _problem(info: dict[str, Any], fmt: LowpFormat, th: Any) -> str | None:
    for key in _LIMITED:
        value = info.get(key)
        if value is not None and _excess(value, info.get(f"nominal_{key}") or 0.0, th) > _limit(
            key, th
        ):
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
        f"{_pct(base * (1 + th.nominal_margin) + _limit(problem, th))})"
    )


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.2%}"
