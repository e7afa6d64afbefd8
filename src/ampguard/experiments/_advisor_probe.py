"""The model advisor's probe half: what fp16 would do to the values an fp32 probe saw.

Turns a :class:`~ampguard.experiments._range_probe.ProbeResult` into findings (AG321 upgrade,
AG326-AG332)
and the precision plan (AG331). Modules are named as in ``model.named_modules()``; a hazard is
reported on the innermost module that shows it.
"""

from __future__ import annotations

import math

from torch import nn

from ampguard import precisions
from ampguard.core.policy import supports_bf16
from ampguard.experiments._range_probe import FP16_MAX, ModuleRange, ProbeResult
from ampguard.findings import Finding, make
from ampguard.findings.codes import lookup

__all__ = ["probe_findings", "merge_saturation"]

_HEADROOM = 8.0  # activations within this factor of 65504 get a warning
_FLUSH_SHARE = 0.25  # share of nonzero values flushed to zero that makes a finding
_SATURATED_SHARE = 0.1
_MAX_SCALE = 2.0**24  # ScalerConfig's default cap


def probe_findings(
    model: nn.Module, probe: ProbeResult, inside: list[str] | tuple[str, ...] = ()
) -> list[Finding]:
    """Findings from one fp32 range probe: overflow, underflow, non-finite values, and the plan.

    ``inside``: modules whose fp16 ops overflow inside them (AG361, found by the op-level
    probe): the plan keeps them in fp32 too. Cost: none beyond the probe (reads host values).
    """
    out: list[Finding] = []
    bad = _nonfinite(probe)
    if bad is not None:
        return [bad]
    overflow = _overflowing(probe)
    fp16 = _fp16_ranges(probe, overflow)
    grad_max = max((r.grad_amax for r in fp16), default=0.0)
    scale = _usable_scale(grad_max)
    out += [
        f
        for f in (
            _forward_overflow(overflow),
            _headroom(probe, overflow),
            _grad_overflow(fp16, grad_max),
            _grad_underflow(fp16, scale, grad_max),
            _act_underflow(probe),
        )
        if f is not None
    ]
    out.append(_plan(model, probe, overflow + [m for m in inside if m not in overflow], out, scale))
    return out


def _nonfinite(probe: ProbeResult) -> Finding | None:
    first = next((r for r in probe.ordered() if r.out_nonfinite), None)
    grad = [r.name for r in probe.ordered() if r.grad_nonfinite]
    loss_bad = probe.loss is not None and not math.isfinite(probe.loss)
    if first is None and not grad and not loss_bad:
        return None
    where = (
        f"module {first.name or '<root>'!r} output"
        if first is not None
        else f"gradients of {grad[0] or '<root>'!r}"
        if grad
        else "the loss"
    )
    return make(
        "AG332",
        f"The fp32 probe produced inf/NaN (first at {where}): this is not an AMP problem, and "
        "no precision plan can fix it.",
        evidence={
            "module": first.name if first else None,
            "grad_modules": grad[:10],
            "loss": probe.loss if loss_bad is False else str(probe.loss),
        },
        fix="Fix the model or data first (input values, initialisation, learning rate, a log/div "
        "of zero); ag.locate(..., precision='fp32') names the op.",
    )


def _innermost(names: list[str]) -> list[str]:
    """Drop every name that has a flagged descendant (the descendant explains it)."""
    return [
        n for n in names if not any(o != n and (n == "" or o.startswith(n + ".")) for o in names)
    ]


def _overflowing(probe: ProbeResult) -> list[str]:
    """Modules that would produce or cast an fp16 value past 65504: the keep_fp32 candidates."""
    flagged = []
    for r in probe.ordered():
        # parameter-free leaves (ReLU, Dropout) run in their input's dtype: a big fp32 input
        # passes through them without overflowing; matmul-like modules cast it to fp16.
        passthrough = r.leaf and not r.has_params and r.in_amax > FP16_MAX
        if (r.out_amax > FP16_MAX and not passthrough) or (r.casts_fp16 and r.in_amax > FP16_MAX):
            flagged.append(r.name)
    return _innermost(flagged)


def _fp16_ranges(probe: ProbeResult, keep: list[str]) -> list[ModuleRange]:
    """The modules whose gradients stay fp16 once ``keep`` runs in fp32: leaves and modules with
    parameters (a container's output gradient is its last child's), outside the kept subtrees,
    whose inputs fit fp16 (a module fed an fp32 value past 65504 computes in fp32)."""

    def kept(name: str) -> bool:
        return any(k == "" or name == k or name.startswith(k + ".") for k in keep)

    return [
        r
        for r in probe.ordered()
        if (r.leaf or r.has_params) and not kept(r.name) and r.in_amax <= FP16_MAX
    ]


def _forward_overflow(names: list[str]) -> Finding | None:
    if not names:
        return None
    return make(
        "AG326",
        f"{len(names)} module(s) produce or consume activations beyond fp16's max 65504 in fp32: "
        f"{', '.join(repr(n) for n in names[:8])}. Under fp16 autocast they become inf in the "
        "forward, every step is skipped and the loss scale collapses.",
        evidence={"modules": names},
        fix=f"Keep them in fp32: ag.Guard(..., keep_fp32={names!r}), or use precision='bf16'.",
    )


def _headroom(probe: ProbeResult, overflow: list[str]) -> Finding | None:
    near = _innermost(
        [r.name for r in probe.ordered() if FP16_MAX / _HEADROOM < r.out_amax <= FP16_MAX]
    )
    near = [n for n in near if n not in overflow]
    if not near:
        return None
    amax = {n: probe.modules[n].out_amax for n in near}
    return make(
        "AG327",
        f"{len(near)} module(s) output values within {_HEADROOM:g}x of 65504 "
        f"(largest {max(amax.values()):.4g}); training that grows them will overflow in fp16.",
        evidence={"amax": amax},
        fix="Watch these modules (normalise their inputs, clip weights) or use precision='bf16'.",
    )


def _usable_scale(grad_max: float) -> float:
    """The largest power-of-two loss scale (<= 2**24) at which no probed gradient overflows."""
    if grad_max <= 0.0:
        return _MAX_SCALE
    return min(_MAX_SCALE, 2.0 ** math.floor(math.log2(FP16_MAX / grad_max)))


def _grad_overflow(ranges: list[ModuleRange], grad_max: float) -> Finding | None:
    if grad_max <= FP16_MAX:
        return None
    names = [r.name for r in ranges if r.grad_amax > FP16_MAX]
    return make(
        "AG328",
        f"Unscaled gradients reach {grad_max:.4g} (> 65504) in {', '.join(map(repr, names[:8]))}: "
        "every fp16 step overflows whatever the scale, so the scaler backs off until it collapses.",
        evidence={"grad_amax": grad_max, "modules": names},
        fix="Use precision='bf16' (fp32's range), or reduce the loss magnitude (mean instead of "
        "sum reduction, smaller loss weights).",
    )


def _grad_underflow(ranges: list[ModuleRange], scale: float, grad_max: float) -> Finding | None:
    if grad_max > FP16_MAX or not ranges:
        return None
    frac = {r.name: r.grad_flushed_fraction(scale) for r in ranges}
    names = [n for n, f in frac.items() if f > _FLUSH_SHARE]
    if not names:
        return None
    limiter = max(ranges, key=lambda r: r.grad_amax).name
    return make(
        "AG329",
        f"At loss scale {scale:g} (the largest that keeps the gradients of "
        f"{limiter or '<root>'!r}, max {grad_max:.3g}, finite) fp16 flushes most gradient values "
        f"of {', '.join(map(repr, names[:8]))} to zero: those weights stop learning.",
        evidence={
            "scale": scale,
            "limited_by": limiter,
            "flushed_fraction": {n: round(frac[n], 4) for n in names},
        },
        fix="Use precision='bf16'; fp16's 40 binades cannot hold these gradients at one scale.",
    )


def _act_underflow(probe: ProbeResult) -> Finding | None:
    frac = {r.name: r.flushed_fraction() for r in probe.ordered()}
    names = _innermost([n for n, f in frac.items() if f > _FLUSH_SHARE])
    if not names:
        return None
    return make(
        "AG330",
        f"{', '.join(f'{n!r} ({frac[n]:.0%})' for n in names[:8])}: that share of the nonzero "
        "outputs is below 2**-25 and becomes exactly 0 in fp16 (no loss scale helps a forward).",
        evidence={"flushed_fraction": {n: round(frac[n], 4) for n in names}},
        fix=f"Keep them in fp32 (keep_fp32={names!r}), rescale their inputs, or use bf16.",
    )


def _saturated(probe: ProbeResult) -> dict[str, float]:
    return {
        r.name: round(r.saturated_fraction(), 4)
        for r in probe.ordered()
        if r.saturated_fraction() > _SATURATED_SHARE
    }


def merge_saturation(findings: list[Finding], probe: ProbeResult) -> list[Finding]:
    """Upgrade AG321 to a warning when the probe saw fp16-only saturation."""
    sat = _saturated(probe)
    if not sat:
        return findings
    out = [f for f in findings if f.code != "AG321"]
    out.append(
        make(
            "AG321",
            f"In the probe, {', '.join(f'{n!r} ({v:.0%})' for n, v in sat.items())} of the outputs "
            "are below 1 in fp32 but round to exactly +-1 in fp16: their gradient is zero there "
            "and "
            "log(1 - p) is -inf.",
            severity="warning",
            title=lookup("AG321").title + " round to 1 in fp16",
            evidence={"saturated_fraction": sat},
            fix=f"Keep them in fp32 (keep_fp32={sorted(sat)!r}) and compute losses from logits.",
        )
    )
    return out


def _checked(probe: ProbeResult) -> str:
    """What "fits fp16" was checked on: module outputs (and gradients), never values inside a
    module (a norm's variance, an eps), so the claim says so."""
    what = "module output" if probe.loss is None else "module output or gradient"
    return (
        f"no probed {what} leaves fp16's range (values computed inside a module, such as a "
        "norm's variance or eps, were not probed)"
    )


def _plan(
    model: nn.Module, probe: ProbeResult, overflow: list[str], found: list[Finding], scale: float
) -> Finding:
    """AG331: bf16 when fp16's range cannot hold the values, else fp16 (+ keep_fp32 list)."""
    bf16 = supports_bf16(next((p.device.type for p in model.parameters()), "cpu"))
    range_codes = {f.code for f in found} & {"AG328", "AG329", "AG330"}
    weighted = sum(1 for r in probe.modules.values() if r.has_params)
    many = len(overflow) > max(2, weighted // 4) or "" in overflow  # "" = the whole model
    keep = overflow + [n for n in _saturated(probe) if n not in overflow]
    if bf16 and (range_codes or many):
        precision = "bf16"
        keep = [n for n in keep if n not in overflow]  # bf16 has fp32's range
        why = (
            "fp16's range cannot hold this model's values at one loss scale"
            if range_codes
            else f"{len(overflow)} modules overflow fp16"
        )
    else:
        precision = "fp16"
        why = (
            "a few modules overflow or saturate in fp16; running them in fp32 keeps the rest fast"
            if keep
            else _checked(probe) + (" (bf16 fits too)" if bf16 else "")
        )
    args = [f"precision={precision!r}"] + ([f"keep_fp32={keep!r}"] if keep else [])
    if probe.loss is None:
        scale_text = "Gradients were not probed (pass loss_fn)."
    else:
        scale_text = f"Largest loss scale without gradient overflow: {scale:g}."
        if precisions.get(precision).needs_scaler and scale < 2.0**16:
            args.append(f"scaler=ag.ScalerConfig(init_scale={scale:g})")
    return make(
        "AG331",
        f"Recommended {precision}{f' with keep_fp32={keep!r}' if keep else ''}: {why}. "
        + scale_text,
        detail=precision + (" with keep_fp32" if keep else ""),
        evidence={
            "precision": precision,
            "keep_fp32": keep,
            "usable_scale": None if probe.loss is None else scale,
            "bf16_supported": bf16,
        },
        fix=f"ag.Guard(model, optimizer, {', '.join(args)})",
    )
