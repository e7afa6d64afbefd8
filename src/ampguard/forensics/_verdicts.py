"""Verdicts that agree: the Guard's errors and warnings say what forensics concluded.

A :class:`~ampguard.ScaleCollapseError` (and the ``on_collapse="fallback"`` warning) used to
advise bf16 and keep_fp32 whatever had happened. When the Guard's forensics (``forensics=True``,
``auto_fallback``, or ``step(batch=, loss_fn=)`` replays) diagnosed the run, the advice follows
the strongest diagnosis: non-finite in fp32 too (a model bug: fix the math, never a precision
change), an optimizer eps that underflows, an fp16 overflow at a named module (keep *it* in
fp32, or bf16), an absorbed overflow (keep it in fp32 or normalise; never a larger loss scale).
The error carries the verdict as ``ScaleCollapseError.verdict``. Cost: none (host-side text over
diagnoses already made).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RANK", "strongest", "verdict", "advice"]

# strongest first: a model bug outranks any precision explanation
RANK = (
    "model_nonfinite",
    "eps_underflow",
    "input_nonfinite",
    "fp16_overflow",
    "fp16_overflow_absorbed",
    "fp16_underflow",
    "precision_stagnation",
)


def strongest(diagnoses: list[tuple[int, Any, str]]) -> tuple[int, Any, str] | None:
    """The ``(step, Diagnosis, via)`` the advice rests on: the strongest kind, the latest step."""
    ranked = [t for t in diagnoses if t[1].kind in RANK]
    if not ranked:
        return None
    return min(ranked, key=lambda t: (RANK.index(t[1].kind), -t[0]))


def verdict(forensics: Any) -> dict[str, Any] | None:
    """The verdict as a plain dict (code, kind, phase, module, op, step, via), or None."""
    picked = strongest(forensics.diagnoses) if forensics is not None else None
    if picked is None:
        return None
    step, d, via = picked
    return {
        "code": d.code,
        "kind": d.kind,
        "phase": d.phase,
        "module": d.module,
        "op": d.op,
        "step": step,
        "via": via,
    }


def advice(forensics: Any) -> str | None:
    """The "Try: ..." part of a collapse message that agrees with the verdict, or None (no
    diagnosis: the caller keeps its generic advice)."""
    picked = strongest(forensics.diagnoses) if forensics is not None else None
    if picked is None:
        return None
    step, d, via = picked
    from ampguard.forensics._text import fix_for

    head = f"Forensics ({via} of step {step}): {d}."
    if d.kind in ("model_nonfinite", "input_nonfinite"):
        why = (
            "non-finite in fp32 too: a model bug, not an AMP problem"
            if d.kind == "model_nonfinite"
            else "the batch itself holds NaN/inf"
        )
        return (
            f"{head} It is {why}, so no precision setting fixes it (not bf16, not keep_fp32, "
            f"not a fallback). Fix: {fix_for(d)}"
        )
    return f"{head} Fix: {fix_for(d)}"
