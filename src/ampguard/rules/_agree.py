"""Verdicts that agree: a runtime finding's fix follows the forensic verdict recorded in the run.

The AG1xx rules see the loss scale and the gradients; forensics (``Guard(forensics=True)``,
``auto_fallback``, a replay with ``ag.locate``) sees *why*. When both are in the run log, the
rules' generic advice must not contradict the diagnosis:

==========================================  =====================================================
verdict recorded (the diagnosis's kind)     what the scale / gradient findings say
==========================================  =====================================================
``model_nonfinite`` (AG303): fp32 too       a model bug: fix the math; no bf16/keep_fp32/fallback
``eps_underflow`` (AG366)                   the optimizer step: fp32 master weights, a larger eps
``fp16_overflow`` (AG301) at module M       keep M in fp32 (keep_fp32=['M']) or bf16
``fp16_overflow_absorbed`` at module M      keep M in fp32 / normalise; never a larger loss scale
==========================================  =====================================================

Each finding rewritten carries ``evidence["verdict"]`` (code, kind, module, phase, op, step), so
the report shows what the advice rests on. Findings other than the scale and gradient rules
(AG101, AG102, AG103, AG104, AG105, AG106, AG108, AG109) are left as they are. Imports no torch.
"""

from __future__ import annotations

from typing import Any

from ampguard.findings import Finding

__all__ = ["VERDICT_KINDS", "agree", "verdict_of"]

# the forensic verdicts (a diagnosis finding's evidence["kind"]), strongest first: a model bug
# outranks a precision overflow
VERDICT_KINDS = ("model_nonfinite", "eps_underflow", "fp16_overflow", "fp16_overflow_absorbed")
_SCALE_RULES = {"AG101", "AG102", "AG103", "AG109"}
_GRADIENT_RULES = {"AG104", "AG105", "AG106", "AG108"}


def verdict_of(found: list[Finding]) -> Finding | None:
    """The forensic finding the run's advice must agree with: the strongest code, earliest step."""
    rank = {k: i for i, k in enumerate(VERDICT_KINDS)}

    def kind(f: Finding) -> Any:
        return (f.evidence or {}).get("kind") if f.code.startswith("AG3") else None

    cands = [f for f in found if kind(f) in rank]
    if not cands:
        return None
    return min(cands, key=lambda f: (rank[kind(f)], f.step if f.step is not None else 0))


def _summary(v: Finding) -> dict[str, Any]:
    ev = v.evidence or {}
    return {
        "code": v.code,
        "kind": ev.get("kind"),
        "module": ev.get("module"),
        "phase": ev.get("phase"),
        "op": ev.get("op"),
        "step": v.step,
        "title": v.title,
    }


def _fix(v: Finding, summary: dict[str, Any]) -> str | None:
    module, kind = summary["module"], summary["kind"]
    if kind == "model_nonfinite":
        at = "".join(
            (
                f" at {module!r}" if module is not None else "",
                f" ({op})" if (op := summary["op"]) else "",
            )
        )
        return (
            f"Forensics found the value non-finite in fp32 too{at}: a model bug, not an AMP "
            "problem, so bf16, keep_fp32 and a precision fallback do not help. " + v.fix
        )
    if kind == "eps_underflow":
        return "Forensics traced it to the optimizer step: " + v.fix
    if kind in ("fp16_overflow", "fp16_overflow_absorbed") and module is not None:
        what = "overflows fp16" if kind == "fp16_overflow" else "overflows fp16 inside (absorbed)"
        return f"Forensics: {module!r} {what}; no loss scale fixes it. " + v.fix
    return None


def agree(found: list[Finding]) -> list[Finding]:
    """``found`` with the scale and gradient findings' fix and evidence following the verdict."""
    v = verdict_of(found)
    if v is None:
        return found
    summary = _summary(v)
    fix = _fix(v, summary)
    if fix is None:
        return found
    # these also explain a dead or underflowing layer (a plain overflow skips instead)
    gradient_ok = summary["kind"] in ("model_nonfinite", "eps_underflow", "fp16_overflow_absorbed")
    out = []
    for f in found:
        if f.code in _SCALE_RULES or (gradient_ok and f.code in _GRADIENT_RULES):
            f = Finding(
                f.code,
                f.severity,
                f.title,
                f.message,
                f.step,
                {**(f.evidence or {}), "verdict": summary},
                fix,
            )
        out.append(f)
    return out
