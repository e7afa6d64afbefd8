"""The bound on non-finite skips without a loss scale (bf16, fp32, fp8, and after a fallback).

Under fp16 the loss scale's unscale pass finds non-finite gradients and the window is skipped;
bf16 and fp32 have no scale to lower, but one bad batch (a NaN in the data, a divergent
activation) would still write NaN into every weight it touches. With
``Guard(skip_nonfinite=True)`` (the default) the no-op loss scale checks every window with the
same fused pass (:mod:`ampguard.guard._step`), and a window with non-finite gradients skips.
Skipping forever is no progress either::

    consecutive non-finite skips >= ScalerConfig.max_nonfinite_skips -> on_collapse policy

``"warn"`` warns once per episode; ``"raise"`` and ``"fallback"`` (there is nothing wider to fall
back to) raise :class:`~ampguard.ScaleCollapseError`.
"""

from __future__ import annotations

import warnings

from ampguard._util.stack import user_stacklevel
from ampguard.core import results
from ampguard.core.scaler import ScaleCollapseError
from ampguard.findings import count
from ampguard.guard._step_state import StepState

__all__ = ["over_bound", "on_bound", "after_late_fallback"]


def over_bound(state: StepState) -> bool:
    """True when the run without a scale has skipped ``max_nonfinite_skips`` windows in a row."""
    return (
        not state.scaled and state.counts.consecutive_nonfinite >= state.config.max_nonfinite_skips
    )


def on_bound(state: StepState, step: int, run: int | None = None) -> None:
    """Act on the bound with the collapse policy (see the module docstring).

    ``step``: the window at which the bound was crossed; ``run``: the consecutive non-finite
    windows up to it (default: the count now). With fused optimizers the flags are read lazily
    (at most 100 windows later), so the message then also says when it was seen."""
    cfg = state.config
    precision = state.policy.precision
    n = state.counts.consecutive_nonfinite if run is None else run
    seen = (
        f" (seen at step {state.steps}: fused optimizers' step flags are read lazily, at most "
        "100 windows late)"
        if state.steps > step
        else ""
    )
    fallback = state.fallback
    after = (
        f" (after the {fallback['from']} -> {fallback['to']} fallback at step {fallback['step']})"
        if fallback
        else ""
    )
    msg = (
        f"non-finite gradients in {count(n, 'consecutive window')} up to step {step}{seen} "
        f"under {precision}{after}; each was skipped, so the weights are unchanged, but "
        f"training makes no progress (ScalerConfig.max_nonfinite_skips="
        f"{cfg.max_nonfinite_skips}). There is no loss scale to lower in {precision}: "
        "the loss or the data is non-finite. Try: ampguard.locate(model, loss_fn, batch) to "
        "name the first module with a non-finite value; check the batch for NaN/inf; a lower "
        "learning rate; or ScalerConfig(on_collapse='warn') to keep skipping."
    )
    if cfg.on_collapse == "warn":
        if not state.collapsing:
            warnings.warn(msg, RuntimeWarning, stacklevel=user_stacklevel())
        state.collapsing = True
        return
    raise ScaleCollapseError(msg)


def after_late_fallback(state: StepState, tail: list[tuple[int, results.Decoded]]) -> None:
    """A collapse fallback acted on late (fused optimizers' flags, read up to 100 windows after
    the collapse): ``tail``, the settled ``(step, flags)`` of the windows after the collapse step,
    ran without progress as much as the new precision's would; their skips count toward
    ``max_nonfinite_skips``, so the bound fires within the lazy read's 100 windows of the step at
    which it was crossed (not 100 windows after the fallback was seen). Cost: none (host values).
    """
    limit = state.config.max_nonfinite_skips
    run, crossed = 0, None
    for step, flags in tail:
        run = 0 if flags.applied else run + 1
        if crossed is None and run >= limit:
            crossed = step
    state.counts.consecutive_nonfinite = run
    if crossed is not None:
        on_bound(state, crossed, limit)
