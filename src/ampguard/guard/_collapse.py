"""What the Guard does when its loss scale collapses: raise, warn, or fall back.

A collapse is an overflow while the scale is already at ``min_scale`` (every window skips, the
scale cannot go lower). ``ScalerConfig.on_collapse`` decides: ``"raise"``
(:class:`~ampguard.ScaleCollapseError`, with the forensic verdict when there is one), ``"warn"``
(once per episode; an applied window ends it) or ``"fallback"``: the Guard continues in bf16
(fp32 where the device has no bf16) with the no-op loss scale, and records the change. Without a
scale, the bound on consecutive non-finite skips takes its place (:mod:`ampguard.guard._nonfinite`).
"""

from __future__ import annotations

import warnings

from ampguard._util.stack import user_stacklevel
from ampguard.core.policy import resolve_precision, supports_bf16
from ampguard.core.scaler import ScaleCollapseError, collect_grads
from ampguard.findings import count
from ampguard.forensics import advice as forensics_advice
from ampguard.forensics import verdict
from ampguard.guard import _nonfinite
from ampguard.guard._step_state import StepState

__all__ = ["on_collapse", "collapse_message", "fall_back"]


def on_collapse(state: StepState, step: int, run: int | None = None) -> None:
    """Act on a collapse at window ``step`` with the collapse policy (``run``: the non-finite
    windows in a row up to it, for the bound without a scale)."""
    if not state.scaled:  # no scale to lower: the bound on non-finite skips
        return _nonfinite.on_bound(state, step, run)
    policy = state.config.on_collapse
    if policy == "raise":
        raise ScaleCollapseError(collapse_message(state, step), verdict=verdict(state.forensics))
    if policy == "warn":
        if not state.collapsing:
            warnings.warn(
                collapse_message(state, step), RuntimeWarning, stacklevel=user_stacklevel()
            )
        state.collapsing = True
        return
    fall_back(state, step)


def collapse_message(state: StepState, step: int) -> str:
    """The collapse, its scale history and what to do (forensics' advice when it has one)."""
    hist = ", ".join(f"{s}: {v:g}" for s, v in state.history.tail(state.steps, 8))
    return (
        f"loss scale collapsed at step {step}: gradients overflow even at min_scale="
        f"{state.config.min_scale:g}; {state.counts.skipped} of "
        f"{count(state.steps, 'step')} "
        f"skipped. Scale history (step: scale): {hist}. "
        + (
            forensics_advice(state.forensics)  # what forensics concluded, if it did
            or "Try: precision='bf16' (same range as fp32); keep the overflowing module in "
            "fp32 (ampguard.locate names it); a lower learning rate; or "
            "ScalerConfig(on_collapse='fallback') to switch automatically."
        )
    )


def fall_back(state: StepState, step: int) -> None:
    """Switch to bf16 (fp32 without bf16) and the no-op scale; record and report it."""
    target = "bf16" if supports_bf16(state.device.type) else "fp32"
    old = state.policy.precision
    state.policy = resolve_precision(target, state.device)
    if state.micro and state.scaled:
        # acted on mid-window (a lazy fused flag read): the window's gradients so far carry
        # the old loss scale, the rest of the window will not
        grads = collect_grads(state.params)
        if state.contain is not None:
            grads += state.contain.buffers()
        state.loss_scale.unscale_(grads)
    state.loss_scale = state.new_loss_scale()  # the no-op scale of bf16/fp32
    state.pending.clear()
    state.fallback = {"step": step, "from": old, "to": target}
    if state.telemetry is not None:
        state.telemetry.on_fallback(step, old, target)
    warnings.warn(
        f"loss scale collapsed at step {step}; ampguard switched precision {old} -> {target} "
        "(ScalerConfig.on_collapse='fallback') and continues without a loss scaler."
        + (f" {advice}" if (advice := forensics_advice(state.forensics)) else ""),
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
