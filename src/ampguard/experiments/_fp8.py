"""fp8 variants of :func:`ampguard.compare`: ``fp8`` (every eligible Linear in fp8) and
``fp8_planned`` (only the layers :func:`ampguard.fp8_plan` finds ready), judged against fp32
(as every variant) and against bf16, whose final loss is the fp8 target.

fp8 is judged against bf16's own run-to-run noise at the same steps: when an fp8 variant runs,
compare trains bf16 a second time with the next seed (``seed + 1``: another initialisation, and
other data if the factory draws it from the seeded RNGs). Over the last tenth of the steps, with
``d`` the step-by-step loss difference of the two bf16 runs, the noise is
``max(|mean(d)|, std(d) / sqrt(len(d)))``. An fp8 variant is *like bf16* when it trains (fp32's
criteria) and its final loss (mean of the last tenth) is at most ``max(3 * noise, 0.5% of bf16's
final loss)`` above bf16's (ending lower is never held against it). Verdict:

- ``fp8_ok`` (AG337): naive fp8 is like bf16 (or, when only the planned variant ran, that one);
- ``fp8_keep_layers`` (AG338): naive fp8 is not, the planned one is: keep the plan's named layers
  in bf16;
- ``fp8_fails`` (AG339): no fp8 variant is like bf16: keep the named layers (or all) in bf16.
"""

from __future__ import annotations

import math
from typing import Any

from ampguard import precisions

__all__ = [
    "FP8_VARIANTS",
    "FP8_VERDICTS",
    "FP8_CODES",
    "make_plan",
    "judge_fp8",
    "fp8_lines",
    "bf16_noise",
    "tolerance",
]

FP8_VARIANTS = {
    "fp8": "fp8 (torchao float8) for every eligible Linear, bf16 autocast around it",
    "fp8_planned": "fp8 for the Linear layers ag.fp8_plan finds ready, the rest in bf16",
}
FP8_VERDICTS = ("fp8_ok", "fp8_keep_layers", "fp8_fails")
FP8_CODES = {"fp8_ok": "AG337", "fp8_keep_layers": "AG338", "fp8_fails": "AG339"}  # catalogued
_FP16 = ("fp16_dynamic", "fp16_fixed", "fp16_noscaler")


def make_plan(exp: Any, batch: Any) -> Any:
    """The plan of the experiment's model on its first batch (the ``fp8_planned`` filter)."""
    from ampguard.fp8 import fp8_plan

    return fp8_plan(exp.model, exp.loss_fn, batch)


def _tail(losses: list[float]) -> tuple[float, float]:
    k = max(1, len(losses) // 10)
    if not losses:
        return math.nan, math.nan
    return sum(losses[:k]) / k, sum(losses[-k:]) / k


NOISE_FACTOR = 3.0  # an fp8 gap beyond three times bf16's run-to-run noise is real
MIN_TOLERANCE = 0.005  # ... and beyond 0.5% of bf16's final loss (two runs that agree by chance)
# machine epsilon of each format's elements against bf16's (2**-7): how much coarser it rounds
BF16_EPS = 2.0**-7
FORMAT_EPS = {"fp8": 2.0**-3, "fp8_planned": 2.0**-3, "mxfp8": 2.0**-3, "nvfp4": 2.0**-1}
SAME_RUNS = (
    "the two bf16 runs (seeds s and s + 1) are bitwise equal: the factory seeds the RNGs itself "
    "(e.g. torch.manual_seed inside it) or draws nothing from them, so the second seed changed "
    "nothing and no run-to-run noise was measured; the tolerance is fp8's own rounding cost "
    "and the 0.5% floor"
)


def same_runs(bf16: Any, again: Any) -> bool:
    """The two bf16 runs are bitwise equal (their losses at every step)."""
    return again is not None and list(bf16.losses) == list(again.losses)


def rounding_floor(bf16: Any, fp32: Any, name: str) -> float:
    """The gap a healthy model's ``name`` variant shows from rounding alone: bf16's step-by-step
    distance to fp32 (RMS over the run: bf16's own rounding cost) times how much coarser the
    format's elements round than bf16's (``FORMAT_EPS[name] / BF16_EPS``: 16 for e4m3). 0 when
    fp32 did not run or either run is not finite."""
    if fp32 is None:
        return 0.0
    diffs = [b - f for b, f in zip(bf16.losses, fp32.losses, strict=False)]
    if not diffs or not all(math.isfinite(d) for d in diffs):
        return 0.0
    rms = math.sqrt(sum(d * d for d in diffs) / len(diffs))
    return FORMAT_EPS.get(name, BF16_EPS) / BF16_EPS * rms


def bf16_noise(bf16: Any, again: Any) -> float:
    """bf16's run-to-run noise in the final loss: two bf16 runs (seeds ``s`` and ``s + 1``)
    compared at the same steps over the last tenth, ``max(|mean(d)|, std(d) / sqrt(n))``.
    NaN when either run has no finite tail."""
    n = min(len(bf16.losses), len(again.losses))
    k = max(1, n // 10)
    diffs = [b - a for a, b in zip(bf16.losses[n - k : n], again.losses[n - k : n], strict=True)]
    if not diffs or not all(math.isfinite(d) for d in diffs):
        return math.nan
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / max(1, len(diffs) - 1)
    return max(abs(mean), math.sqrt(var / len(diffs)))


def tolerance(bf16: Any, noise: float, rounding: float = 0.0) -> float:
    """How far above bf16's final loss an fp8 variant may end and still be like bf16: three
    times bf16's noise, never below 0.5% of bf16's final loss nor the format's own
    ``rounding`` cost (:func:`rounding_floor`)."""
    _, tail_b = _tail(bf16.losses)
    floor = MIN_TOLERANCE * abs(tail_b) if math.isfinite(tail_b) else 0.0
    floor = max(floor, rounding if math.isfinite(rounding) else 0.0)
    if not math.isfinite(noise):
        return max(floor, 1e-12)
    return max(NOISE_FACTOR * noise, floor, 1e-12)


def measure_noise(bf16: Any, again: Any) -> tuple[float, str | None]:
    """bf16's noise and, when none was measured, why (NaN and the reason)."""
    if again is None:
        return math.nan, "no second bf16 run"
    if same_runs(bf16, again):
        return math.nan, SAME_RUNS
    return bf16_noise(bf16, again), None


def _like_bf16(r: Any, bf16: Any, tol: float) -> bool:
    _, tail_b = _tail(bf16.losses)
    _, tail = _tail(r.losses)
    gap = tail - tail_b
    r.gap_to_bf16 = gap if math.isfinite(gap) else None
    if r.trained and bf16.trained:
        r.reason += f"; gap to bf16 {gap:+.3g} (tolerance {tol:.3g})"
    return bool(r.trained and math.isfinite(gap) and gap <= tol)


def judge_fp8(cmp: Any, plan: Any, bf16_again: Any = None) -> None:
    """Add the fp8 verdict to ``cmp`` (after the fp32 judgement): ``cmp.extra["fp8"]``; and it
    becomes ``cmp.verdict`` when no fp16 variant ran and fp32 trained.

    ``bf16_again``: the second bf16 run (the next seed) that measures bf16's noise; without it
    the tolerance is the 0.5% floor."""
    results = cmp.variants
    runs = [results[n] for n in FP8_VARIANTS if n in results]
    bf16 = results.get("bf16")
    if not runs or bf16 is None:
        return
    noise, why = measure_noise(bf16, bf16_again)
    rounding = rounding_floor(bf16, results.get(precisions.full()), "fp8")
    tol = tolerance(bf16, noise, rounding)
    like = {r.name: _like_bf16(r, bf16, tol) for r in runs}
    keep = [] if plan is None else list(plan.keep_bf16)
    names = ", ".join(repr(n) for n in keep) or "none"
    every, planned = like.get("fp8"), like.get("fp8_planned")  # None: the variant did not run
    if every or every is None and planned:
        r = results["fp8"] if every else results["fp8_planned"]
        verdict = "fp8_ok"
        text = f"{r.name} trains like bf16 ({r.reason})."
        fix = ""
    elif like.get("fp8_planned"):
        verdict = "fp8_keep_layers"
        text = (
            f"fp8 on every eligible Linear does not train like bf16 ({results['fp8'].reason})"
            f"; with the plan's filter it does ({results['fp8_planned'].reason})."
        )
        fix = (
            f"Keep these layers out of fp8: {names}: ag.Guard(model, optimizer, "
            "precision='fp8', fp8_plan=ag.fp8_plan(model, loss_fn, batch))."
        )
    else:
        verdict = "fp8_fails"
        text = (
            "No fp8 variant trains like bf16: "
            + "; ".join(f"{r.name}: {r.reason}" for r in runs)
            + f". bf16: {bf16.reason}."
        )
        fix = (
            f"Keep these layers out of fp8: {names} (the plan's verdicts), and if fp8 still "
            "does not match bf16, train in bf16."
            if keep
            else "Train in bf16."
        )
    if why == SAME_RUNS:
        text += f" Note: {SAME_RUNS} ({tol:.3g})."
    code = FP8_CODES[verdict]
    cmp.extra["fp8"] = {
        "verdict": verdict,
        "code": code,
        "explanation": text,
        "fix": fix,
        "keep_bf16": keep,
        "plan": None if plan is None else plan.to_dict(),
        "bf16_noise": noise if math.isfinite(noise) else None,
        "noise_measured": math.isfinite(noise),
        "noise_reason": why,
        "rounding_floor": rounding,
        "tolerance": tol,
        "noise_seed_losses": None if bf16_again is None else list(bf16_again.losses),
    }
    if results[precisions.full()].trained and not any(n in results for n in _FP16):
        cmp.verdict, cmp.explanation, cmp.fix = verdict, text, fix


def fp8_lines(cmp: Any) -> list[str]:
    """Summary lines for the fp8 verdict when it is not the main verdict; else []."""
    info = cmp.extra.get("fp8")
    if not info:
        return []
    gaps = [
        f"{r.name} {r.gap_to_bf16:+.4g}"
        for n, r in cmp.variants.items()
        if n in FP8_VARIANTS and r.gap_to_bf16 is not None
    ]
    noise = info.get("bf16_noise")
    against = (
        f" (tolerance {info['tolerance']:.3g}: 3x bf16's run-to-run noise {noise:.3g}, at "
        f"least fp8's rounding cost {info.get('rounding_floor', 0.0):.3g})"
        if noise is not None and "tolerance" in info
        else f" (tolerance {info['tolerance']:.3g}: {info['noise_reason']})"
        if info.get("noise_reason") and "tolerance" in info
        else ""
    )
    out = [f"fp8 final loss gap to bf16: {', '.join(gaps)}{against}" if gaps else ""]
    if info["verdict"] != cmp.verdict:
        out += [f"fp8 verdict: {info['verdict']} ({info['code']})", info["explanation"]]
        if info["fix"]:
            out.append(f"fp8 fix: {info['fix']}")
    return [line for line in out if line]
