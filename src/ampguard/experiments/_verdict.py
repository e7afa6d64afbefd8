"""How :func:`ampguard.compare` judges its variants: did each train, and what is the verdict.

A variant *trains* when it did not raise, its parameters and its last losses are finite, it
skipped at most a quarter of its steps, and its final loss (mean of the last tenth of the steps)
is within a quarter of fp32's progress (or 5% of fp32's final loss, whichever is larger) of the
fp32 final loss. fp32 *trains* when its losses and parameters stay finite and its final loss is
not 100x its first. Verdict: fp32 fails -> ``model_problem``; fp16 with dynamic scaling trains ->
``amp_ok``; the deciding variant (dynamic scaling, else the first that failed) stayed finite and
skipped little but its loss is far above fp32's at the same applied steps -> ``silent_stall``
(:mod:`ampguard.experiments._stall`); fixed scale 64 trains -> ``dynamic_scale_conflict``;
otherwise -> ``fp16_range``.
"""

from __future__ import annotations

import math
from typing import Any

from ampguard import precisions
from ampguard._util.jsonnum import finite_or_none as json_float
from ampguard.experiments import _stall
from ampguard.experiments._fp8 import FP8_CODES as _FP8_CODES
from ampguard.experiments._fp8 import fp8_lines
from ampguard.experiments._lowp import lowp_lines

__all__ = [
    "VERDICTS",
    "CODES",
    "judge",
    "summary",
    "explain",
    "add_diagnosis",
    "finite",
    "json_float",
]

VERDICTS = (
    "amp_ok",
    "dynamic_scale_conflict",
    "fp16_range",
    "model_problem",
    "silent_stall",
    "fp8_ok",
    "fp8_keep_layers",
    "fp8_fails",
)  # fp8: ampguard.experiments._fp8
CODES = {  # verdict -> finding code (title and severity: ampguard.findings.codes.CATALOGUE)
    "amp_ok": "AG333",
    "dynamic_scale_conflict": "AG334",
    "fp16_range": "AG335",
    "model_problem": "AG336",
    "silent_stall": "AG367",
    **_FP8_CODES,
}
MAX_SKIP_FRACTION = 0.25
TAIL_RTOL = 0.25
DIVERGE_FACTOR = 100.0


def finite(x: float) -> bool:
    return math.isfinite(x)


def _window(losses: list[float]) -> int:
    return max(1, len(losses) // 10)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _head_tail(losses: list[float]) -> tuple[float, float]:
    k = _window(losses)
    return _mean(losses[:k]), _mean(losses[-k:])


def _max_rel_dev(losses: list[float], base: list[float]) -> float:
    worst = 0.0
    for x, b in zip(losses, base, strict=False):
        if not finite(b):
            continue
        if not finite(x):
            return math.inf
        worst = max(worst, abs(x - b) / max(abs(b), 1e-12))
    return worst


def _judge_fp32(r: Any) -> None:
    head, tail = _head_tail(r.losses)
    bad = r.first_bad_step
    if not r.losses:
        r.reason = "no batches: the experiment's batches were empty"
    elif bad is not None:
        r.reason = f"loss became non-finite at step {bad}"
    elif not r.params_finite:
        r.reason = "parameters became non-finite"
    elif abs(tail) > DIVERGE_FACTOR * max(abs(head), 1e-8):
        r.reason = f"diverged: final loss {tail:.4g} vs {head:.4g} at the start"
    else:
        r.trained, r.reason = True, f"final loss {tail:.4g} (from {head:.4g})"


def _judge_amp(r: Any, base: Any, steps: int) -> None:
    head_f, tail_f = _head_tail(base.losses)
    _, tail = _head_tail(r.losses) if r.losses else (math.nan, math.nan)
    tol = TAIL_RTOL * max(abs(head_f - tail_f), 0.05 * abs(tail_f), 1e-12)
    if r.error is not None:
        r.reason = f"raised {r.error}"
    elif not r.params_finite:
        r.reason = f"parameters became non-finite, first bad step {r.first_bad_step}"
    elif not finite(tail):
        r.reason = f"loss non-finite at the end, first at step {r.first_bad_step}"
    elif r.skipped > MAX_SKIP_FRACTION * max(len(r.losses), 1):
        r.reason = f"skipped {r.skipped} of {len(r.losses)} steps"
    elif abs(tail - tail_f) > tol:
        r.reason = f"final loss {tail:.4g} vs fp32 {tail_f:.4g}"
    else:
        r.trained = True
        r.reason = f"final loss {tail:.4g} vs fp32 {tail_f:.4g}, {r.skipped} skipped"
    r.max_rel_dev = _max_rel_dev(r.losses, base.losses)
    ok = r.step_seconds > 0 and base.step_seconds > 0  # False for NaN (too few steps)
    r.throughput_ratio = base.step_seconds / r.step_seconds if ok else math.nan


def judge(results: dict[str, Any], steps: int) -> tuple[str, str, str]:
    """Fill in each variant's ``trained``/``reason``/ratios; return the verdict, its
    explanation and its fix (the caller builds the Comparison from them)."""
    base = results[precisions.full()]  # the reference variant: autocast off
    _judge_fp32(base)
    for name, r in results.items():
        if name != precisions.full():
            _judge_amp(r, base, steps)
    verdict = _verdict(results)
    explanation, fix = _explain(verdict, results)
    return verdict, explanation, fix


def _verdict(results: dict[str, Any]) -> str:
    verdict = _loud_verdict(results)
    if verdict in ("dynamic_scale_conflict", "fp16_range") and _stall.pick(
        results, TAIL_RTOL, MAX_SKIP_FRACTION
    ):
        return "silent_stall"
    return verdict


def _loud_verdict(results: dict[str, Any]) -> str:
    if not results[precisions.full()].trained:
        return "model_problem"
    dyn, fixed = results.get("fp16_dynamic"), results.get("fp16_fixed")
    if dyn is not None:
        if dyn.trained:
            return "amp_ok"
        if fixed is not None and fixed.trained:
            return "dynamic_scale_conflict"
        return "fp16_range"
    # No dynamic-scale run: no conflict to explain; an fp16 variant that trains is enough.
    if all(r.trained for r in results.values()) or (fixed is not None and fixed.trained):
        return "amp_ok"
    return "fp16_range"


def _explain(verdict: str, results: dict[str, Any]) -> tuple[str, str]:
    base = results[precisions.full()]
    dyn, fixed, bf16 = (results.get(n) for n in ("fp16_dynamic", "fp16_fixed", "bf16"))
    if verdict == "model_problem":
        return (
            f"fp32 fails too ({base.reason}): this is not an AMP problem.",
            "Fix the model or data first: lower the learning rate, check inputs and "
            "initialisation; ampguard.locate(model, loss_fn, batch, precision='fp32') names "
            "the first non-finite op.",
        )
    if verdict == "amp_ok":
        r = dyn or next((r for n, r in results.items() if n != base.name and r.trained), base)
        failed = "".join(
            f" {f.name} fails ({f.reason})." for f in results.values() if not f.trained
        )
        return (
            f"{r.name} trains like fp32 ({r.reason}; max relative loss deviation "
            f"{r.max_rel_dev:.3g}; {r.throughput_ratio:.2f}x fp32 throughput).{failed}",
            "",
        )
    if verdict == "silent_stall":
        picked = _stall.pick(results, TAIL_RTOL, MAX_SKIP_FRACTION)
        assert picked is not None
        return _stall.explain(picked[0], results[picked[0]], picked[1])
    if verdict == "dynamic_scale_conflict" and dyn is not None and fixed is not None:
        return (
            f"fp16 with dynamic scaling fails ({dyn.reason}; final scale "
            f"{dyn.final_scale:g}) while a fixed scale of 64 trains ({fixed.reason}): the "
            "gradients overflow at the scale levels the dynamic scaler probes, and every "
            "probe costs a skipped step.",
            "Start and cap the scale where it trains and probe rarely: ag.ScalerConfig("
            "init_scale=64.0, max_scale=64.0) or a longer growth_interval (e.g. 2000+).",
        )
    failed = next(r for r in (fixed, dyn, *results.values()) if r is not None and not r.trained)
    bf_ok = bf16 is not None and bf16.trained
    bf = "bf16 trains" if bf_ok else "bf16 fails too" if bf16 is not None else "bf16 was not run"
    fix = (
        (
            "Use precision='bf16' (fp32's range), or keep the overflowing modules in fp32: "
            "Guard(..., keep_fp32=[...])."
        )
        if bf16 is None or bf_ok
        else (
            "Keep the overflowing modules in fp32 (Guard(..., keep_fp32=[...]); ampguard.locate "
            "names them), or train in fp32."
        )
    )
    return (
        f"{failed.description} fails ({failed.reason}) while fp32 trains; {bf}. "
        "Values leave fp16's range (max 65504), which no loss scale fixes.",
        fix,
    )


def explain(diagnosis: Any) -> str | None:
    """A diagnosis as text (its ``explain()`` when it has one)."""
    if diagnosis is None:
        return None
    fn = getattr(diagnosis, "explain", None)
    return str(fn()) if callable(fn) else str(diagnosis)


def add_diagnosis(cmp: Any) -> None:
    """Fold the ``locate`` diagnosis into the fp16_range explanation and fix."""
    diag = cmp.diagnosis
    cmp.explanation += f" locate on batch #{cmp.failing_batch}: {explain(diag)}"
    module = getattr(diag, "module", None)
    if getattr(diag, "kind", None) in ("fp16_overflow", "fp16_underflow") and module is not None:
        cmp.fix = (
            f"Keep {module or '<root>'!r} in fp32: ag.Guard(..., keep_fp32=[{module!r}]), "
            "or use precision='bf16'."
        )


def summary(cmp: Any) -> str:
    """Plain-text table of the variants, then the verdict, explanation and fix."""
    rows = [
        (
            "variant",
            "trained",
            "skipped",
            "final scale",
            "max rel dev",
            "speed vs fp32",
            "final loss",
        )
    ]
    for r in cmp.variants.values():
        _, tail = _head_tail(r.losses) if r.losses else (math.nan, math.nan)
        rows.append(
            (
                r.name,
                "yes" if r.trained else "NO",
                str(r.skipped),
                "-" if r.final_scale is None else f"{r.final_scale:g}",
                f"{r.max_rel_dev:.3g}",
                f"{r.throughput_ratio:.2f}x",
                f"{tail:.4g}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    code = CODES[cmp.verdict]
    lines += ["", f"verdict: {cmp.verdict} ({code})", cmp.explanation]
    if cmp.fix:
        lines.append(f"fix: {cmp.fix}")
    if cmp.locate_error:
        lines.append(f"note: {cmp.locate_error}")
    lines += fp8_lines(cmp)  # fp8 variants: gap to bf16, and their verdict if not the main one
    lines += lowp_lines(cmp)  # mxfp8 / nvfp4 variants: like bf16 or not
    return "\n".join(lines)
