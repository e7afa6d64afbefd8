"""Runtime rules AG109-AG110: non-finite gradients in a run without a loss scaler (bf16/fp32).

AG109  a guarded step was skipped for non-finite gradients (``Guard(skip_nonfinite=True)``);
       an error when the skips ran ``max_nonfinite_skips`` windows in a row (the run stopped
       learning), else a warning.
AG110  a step ampguard only watches (``ag.watch`` without a scaler, a framework's bf16/fp32 step)
       applied non-finite gradients: the weights it touched now hold NaN/inf.
"""

from __future__ import annotations

import numpy as np

from ampguard.findings import Finding, count
from ampguard.rules._base import RuleConfig
from ampguard.rules._base import make_finding as _finding
from ampguard.runlog import RunLog

__all__ = ["ag109", "ag110"]

_MAX_STEPS = 20  # steps listed in evidence
_LOCATE = (
    "ampguard.locate(model, loss_fn, batch) names the first module with a non-finite "
    "value (or shows the batch itself is non-finite)"
)


def ag109(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    if len(run.nonfinite) != len(run.steps):
        return []
    idx = np.flatnonzero(run.nonfinite & ~run.applied)
    if not len(idx):
        return []
    steps = run.steps[idx]
    streak = _longest_streak(run.nonfinite & ~run.applied)
    bound = int(run.scaler_config().get("max_nonfinite_skips", 16))
    stopped = streak >= bound
    first = int(steps[0])
    message = (
        f"{count(len(idx), 'step')} had non-finite gradients without a loss scaler and "
        f"{'was' if len(idx) == 1 else 'were'} skipped (first at step {first}; longest run "
        f"{count(streak, 'step')} in a row). The weights never received them."
    )
    if stopped:
        message += (
            f" {streak} in a row reached ScalerConfig.max_nonfinite_skips={bound}: "
            "the run stopped learning there."
        )
    return [
        _finding(
            "AG109",
            "error" if stopped else "warning",
            message,
            first,
            {
                "steps": steps[:_MAX_STEPS].tolist(),
                "count": len(idx),
                "longest_streak": streak,
                "max_nonfinite_skips": bound,
                "precision": sorted({run.precision[i] for i in idx}),
            },
            f"Non-finite values under bf16/fp32 come from the data, the loss or a diverging model, "
            f"not from a loss scale: {_LOCATE}; check the batch for NaN/inf; lower the learning "
            "rate or clip gradients (clip_grad_norm=...).",
        )
    ]


def ag110(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    if len(run.nonfinite) != len(run.steps):
        return []
    idx = np.flatnonzero(run.nonfinite & run.applied)
    if not len(idx):
        return []
    steps = run.steps[idx]
    framework = (run.meta.get("scaler") or {}).get("framework", "the training loop")
    return [
        _finding(
            "AG110",
            "error",
            f"{count(len(idx), 'optimizer step')} applied non-finite gradients (first at step "
            f"{int(steps[0])}): {framework} runs without a loss scaler, so nothing skipped "
            f"{'it' if len(idx) == 1 else 'them'}, and the parameters they touched are now "
            "NaN/inf.",
            int(steps[0]),
            {"steps": steps[:_MAX_STEPS].tolist(), "count": len(idx), "framework": framework},
            "Train with ampguard.Guard (it skips non-finite steps in bf16/fp32 by default) or "
            "skip "
            f"the step yourself when the gradients are not finite; {_LOCATE}.",
        )
    ]


def _longest_streak(mask: np.ndarray) -> int:
    best = run = 0
    for value in mask.tolist():
        run = run + 1 if value else 0
        best = max(best, run)
    return best
