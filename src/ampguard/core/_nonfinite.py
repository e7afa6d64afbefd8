"""The guarded step without a loss scaler (bf16/fp32): non-finite gradients never reach the weights.

Under fp16 the loss scaler's unscale pass finds non-finite gradients and the step is skipped.
bf16 and fp32 have no scale to lower, but one bad batch (a NaN in the data, a divergent
activation) still writes NaN into every weight it touches. With ``Guard(skip_nonfinite=True)``
(the default) every window gets the same fused multi-tensor check as fp16 (torch's
``_amp_foreach_non_finite_check_and_unscale_`` with ``inv_scale=1``: the gradients are read,
never changed) and the optimizers skip a window whose gradients are not finite::

    found_i = any non-finite gradient of optimizer i        # one multi-tensor pass, no sync
    clip with the norm of the finite optimizers             # as under fp16
    fused optimizer: step(found_inf=found_i)                # the kernel skips itself: no sync
    otherwise:      read the flags (one host sync), step the finite optimizers only
    consecutive non-finite skips >= ScalerConfig.max_nonfinite_skips -> on_collapse policy

``skip_nonfinite=False`` is the unchecked path (no check, no sync): whatever the gradients hold
is applied.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ampguard._util.stack import user_stacklevel
from ampguard._util.tensors import is_fused as _is_fused
from ampguard._util.tensors import params_of as _params_of
from ampguard.core import results
from ampguard.core.results import StepResult
from ampguard.core.scaler import ScaleCollapseError, collect_grads
from ampguard.findings import count

__all__ = ["step_unscaled", "over_bound", "on_bound", "after_late_fallback", "check_grads"]


def check_grads(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-dim fp32 flag, nonzero when any of ``grads`` holds a NaN or inf. Cost: no host sync.

    torch's fused AMP check with ``inv_scale=1``: one multi-tensor pass per (device, dtype)
    group; multiplying by exactly 1.0 leaves every gradient bitwise as it was.
    """
    found = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group in groups.items():
        local = found if dev == found.device else torch.zeros((), dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, local, torch.ones((), dtype=torch.float32, device=dev)
        )
        if local is not found:
            found.add_(local.to(device))
    return found


def step_unscaled(guard: Any, kwargs: dict[str, Any]) -> StepResult:
    """One window's step without a loss scaler. Cost: see the module docstring."""
    dropped, all_dropped = (None, None)
    if guard._contain is not None:
        dropped, all_dropped = guard._contain.install(guard._params)
    if not guard.skip_nonfinite:
        return _step_unchecked(guard, kwargs, dropped, all_dropped)
    found = []
    for opt in guard.optimizers:
        grads = collect_grads(_params_of(opt))
        if guard._dist is not None:  # distributed: check the rank-local shards
            grads = guard._dist.local_grads(grads)
        f = check_grads(grads, guard._device)
        found.append(f if all_dropped is None else f + all_dropped)
    agree = (
        None if guard._dist is None else guard._dist.start_consensus(found, dropped, guard._steps)
    )
    tel = guard._telemetry
    if tel is not None and guard._steps >= tel.next_sample:  # a gradient sample is due
        tel.on_grads(guard._steps, False)
    grad_norm = guard._clip(found)
    if agree is not None:
        found, dropped = agree.wait()
        grad_norm = guard._dist.plain_tensor(grad_norm)
    status = results.pack(found, dropped, guard._loss_bad)
    fused = [_is_fused(opt) for opt in guard.optimizers]
    if all(fused):  # no host sync: the kernels skip themselves on found_inf
        if guard._telemetry is not None:
            guard._telemetry.on_step(guard._steps, status, grad_norm)
        for opt, f in zip(guard.optimizers, found, strict=True):
            _fused_step(opt, f, kwargs)
        result = StepResult(guard._steps, True, grad_norm, None, owner=guard)
        guard._pending.append((result, status))
        return result
    packed = int(status.item())  # the one sync
    if guard._telemetry is not None:
        guard._telemetry.on_step(guard._steps, packed, grad_norm)
    flags = results.decode(packed, len(found), scaled=False)
    for opt, f, ok, is_fused in zip(
        guard.optimizers, found, flags.applied_per_optimizer, fused, strict=True
    ):
        if is_fused:
            _fused_step(opt, f, kwargs)
        elif ok:
            opt.step(**kwargs)
    result = StepResult(guard._steps, True, grad_norm, flags)
    guard._settle(guard._steps, flags)
    return result


def _step_unchecked(
    guard: Any,
    kwargs: dict[str, Any],
    dropped: torch.Tensor | None,
    all_dropped: torch.Tensor | None,
) -> StepResult:
    """``skip_nonfinite=False``: no check and no sync, except containment's (a window whose
    micro-batches were all dropped has zero gradients and must skip)."""
    n = len(guard.optimizers)
    status = None if all_dropped is None else results.pack([all_dropped] * n, dropped)
    tel = guard._telemetry
    if tel is not None and guard._steps >= tel.next_sample:  # a gradient sample is due
        tel.on_grads(guard._steps, False)
    grad_norm = guard._clip(None)
    if guard._dist is not None:
        grad_norm = guard._dist.plain_tensor(grad_norm)  # FSDP2: a replicated DTensor
    packed = 0 if status is None else int(status.item())
    flags = results.decode(packed, n, scaled=False)
    if flags.applied:
        for opt in guard.optimizers:
            opt.step(**kwargs)
    if guard._telemetry is not None:
        guard._telemetry.on_step(guard._steps, packed, grad_norm)
    guard._counts.record(flags)
    return StepResult(guard._steps, True, grad_norm, flags)


def _fused_step(opt: torch.optim.Optimizer, found: torch.Tensor, kwargs: dict[str, Any]) -> None:
    # torch's fused Adam/AdamW/SGD skip the update (and undo their step count) on found_inf.
    opt.grad_scale = None  # type: ignore[attr-defined]
    opt.found_inf = found  # type: ignore[attr-defined]
    try:
        opt.step(**kwargs)
    finally:
        del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- the bound
def over_bound(guard: Any) -> bool:
    """True when the run without a scaler has skipped ``max_nonfinite_skips`` windows in a row."""
    return (
        guard._scaler is None
        and guard._counts.consecutive_nonfinite >= guard.scaler_config.max_nonfinite_skips
    )


def on_bound(guard: Any, step: int, run: int | None = None) -> None:
    """Act on the bound with the collapse policy: ``"warn"`` warns once per episode, ``"raise"``
    and ``"fallback"`` (nothing wider to fall back to) raise :class:`ScaleCollapseError`.

    ``step``: the window at which the bound was crossed; ``run``: the consecutive non-finite
    windows up to it (default: the count now). With fused optimizers the flags are read lazily
    (at most 100 windows later), so the message then also says when it was seen."""
    cfg = guard.scaler_config
    n = guard._counts.consecutive_nonfinite if run is None else run
    seen = (
        f" (seen at step {guard._steps}: fused optimizers' step flags are read lazily, at most "
        "100 windows late)"
        if guard._steps > step
        else ""
    )
    after = (
        f" (after the {guard._fallback['from']} -> {guard._fallback['to']} fallback at "
        f"step {guard._fallback['step']})"
        if guard._fallback
        else ""
    )
    msg = (
        f"non-finite gradients in {count(n, 'consecutive window')} up to step {step}{seen} "
        f"under {guard.precision}{after}; each was skipped, so the weights are unchanged, but "
        f"training makes no progress (ScalerConfig.max_nonfinite_skips="
        f"{cfg.max_nonfinite_skips}). There is no loss scale to lower in {guard.precision}: "
        "the loss or the data is non-finite. Try: ampguard.locate(model, loss_fn, batch) to "
        "name the first module with a non-finite value; check the batch for NaN/inf; a lower "
        "learning rate; or ScalerConfig(on_collapse='warn') to keep skipping."
    )
    if cfg.on_collapse == "warn":
        if not guard._collapsing:
            warnings.warn(msg, RuntimeWarning, stacklevel=user_stacklevel())
        guard._collapsing = True
        return
    raise ScaleCollapseError(msg)


def after_late_fallback(guard: Any, tail: list[tuple[int, Any]]) -> None:
    """A collapse fallback acted on late (fused optimizers' flags, read up to 100 windows after
    the collapse): ``tail``, the settled ``(step, flags)`` of the windows after the collapse step,
    ran without progress as much as the new precision's would; their skips count toward
    ``max_nonfinite_skips``, so the bound fires within the lazy read's 100 windows of the step at
    which it was crossed (not 100 windows after the fallback was seen). Cost: none (host values).
    """
    limit = guard.scaler_config.max_nonfinite_skips
    run, crossed = 0, None
    for step, flags in tail:
        run = 0 if flags.applied else run + 1
        if crossed is None and run >= limit:
            crossed = step
    guard._counts.consecutive_nonfinite = run
    if crossed is not None:
        on_bound(guard, crossed, limit)
