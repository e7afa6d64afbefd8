"""fp8 variants of :func:`ampguard.compare`: ``fp8`` (every eligible Linear in fp8) and
``fp8_planned`` (only the layers :func:`ampguard.fp8_plan` finds ready), judged against fp32
(as every variant) and against bf16, whose final loss is the fp8 target.

An fp8 variant is *like bf16* when it trains (fp32's criteria) and its final loss is within a
quarter of bf16's progress (or 5% of bf16's final loss, whichever is larger) of bf16's. Verdict:

- ``fp8_ok`` (AG337): naive fp8 is like bf16 (or, when only the planned variant ran, that one);
- ``fp8_keep_layers`` (AG338): naive fp8 is not, the planned one is: keep the plan's named layers
  in bf16;
- ``fp8_fails`` (AG339): no fp8 variant is like bf16: keep the named layers (or all) in bf16.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FP8_VARIANTS", "FP8_VERDICTS", "FP8_CODES", "make_plan", "judge_fp8", "fp8_lines"]

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


def _like_bf16(r: Any, bf16: Any) -> bool:
    head_b, tail_b = _tail(bf16.losses)
    _, tail = _tail(r.losses)
    tol = 0.25 * max(abs(head_b - tail_b), 0.05 * abs(tail_b), 1e-12)
    gap = tail - tail_b
    r.gap_to_bf16 = gap if math.isfinite(gap) else None
    if r.trained and bf16.trained:
        r.reason += f"; gap to bf16 {gap:+.3g}"
    return bool(r.trained and math.isfinite(gap) and abs(gap) <= tol)


def judge_fp8(cmp: Any, plan: Any) -> None:
    """Add the fp8 verdict to ``cmp`` (after the fp32 judgement): ``cmp.extra["fp8"]``; and it
    becomes ``cmp.verdict`` when no fp16 variant ran and fp32 trained."""
    results = cmp.variants
    runs = [results[n] for n in FP8_VARIANTS if n in results]
    bf16 = results.get("bf16")
    if not runs or bf16 is None:
        return
    like = {r.name: _like_bf16(r, bf16) for r in runs}
    keep = [] if plan is None else list(plan.keep_bf16)
    names = ", ".join(repr(n) for n in keep) or "none"
    if "fp8" in like and like["fp8"] or "fp8" not in like and like.get("fp8_planned"):
        r = results["fp8"] if "fp8" in like else results["fp8_planned"]
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
    code = FP8_CODES[verdict]
    cmp.extra["fp8"] = {
        "verdict": verdict,
        "code": code,
        "explanation": text,
        "fix": fix,
        "keep_bf16": keep,
        "plan": None if plan is None else plan.to_dict(),
    }
    if results["fp32"].trained and not any(n in results for n in _FP16):
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
    out = [f"fp8 final loss gap to bf16: {', '.join(gaps)}" if gaps else ""]
    if info["verdict"] != cmp.verdict:
        out += [f"fp8 verdict: {info['verdict']} ({info['code']})", info["explanation"]]
        if info["fix"]:
            out.append(f"fp8 fix: {info['fix']}")
    return [line for line in out if line]
