"""The Guard's one step over a loss scale: unscale -> clip -> optimizer step -> scale update.

The same code runs every precision; the loss scale (:mod:`ampguard.core.loss_scale`) decides
what "unscale" and "update" are: fp16's dynamic scale unscales the gradients and moves the scale,
bf16/fp32/fp8's no-op scale only checks them (one fused multi-tensor pass with 1.0: the
gradients are read, never changed) and updates nothing::

    found_i = any non-finite gradient of optimizer i        # unscale_ or check_, no sync
    distributed: agree on the flags across ranks (one async all-reduce, overlapped with the clip)
    clip with the norm of the finite optimizers             # the unscaled gradients
    all fused: step(found_inf=found_i), update the scale    # the kernels skip themselves: no sync
    otherwise: update the scale, read the flags (the one host sync), step the finite optimizers

Fused optimizers (``_step_supports_amp_scaling``) under a scale unscale inside their kernel
unless the gradients must be unscaled first (clipping, or a non-fused optimizer in the window).
With ``skip_nonfinite=False`` and no scale the check is left out entirely (no kernel, no sync):
whatever the gradients hold is applied. Cost: the host syncs of ``torch.amp.GradScaler``: one per
window, none for fused optimizers (their flags are read lazily, :mod:`ampguard.guard._flags`).
"""

from __future__ import annotations

from typing import Any

import torch

from ampguard._util.tensors import is_fused
from ampguard._util.tensors import params_of as params_of_optimizer
from ampguard.core import results
from ampguard.core.results import StepResult
from ampguard.core.scaler import collect_grads
from ampguard.guard import _flags
from ampguard.guard._step_state import StepState

__all__ = ["run", "skip_flag"]


def run(state: StepState, owner: object, kwargs: dict[str, Any]) -> StepResult:
    """One window's step (the window is complete: ``state.steps`` already counts it).

    ``owner``: the Guard, which settles a fused window's lazy flags when they are read.
    ``kwargs`` go to ``optimizer.step``. Cost: see the module docstring.
    """
    dropped, all_dropped = (None, None)
    if state.contain is not None:
        dropped, all_dropped = state.contain.install(state.params)
    scale = state.loss_scale
    if not scale.scaled and not state.skip_nonfinite:
        return _unchecked(state, kwargs, dropped, all_dropped)
    fused = [is_fused(opt) for opt in state.optimizers]
    # a scaled window's fused optimizers unscale inside their kernel unless the grads are needed
    # unscaled first; without a scale there is nothing to unscale
    unscale_now = not scale.scaled or state.clip_grad_norm is not None or not all(fused)
    inv = scale.inv_scale() if scale.scaled and unscale_now else None
    found = []
    for opt in state.optimizers:
        grads = collect_grads(params_of_optimizer(opt))
        if state.dist is not None:  # distributed: check the rank-local shards
            grads = state.dist.local_grads(grads)
        f = scale.unscale_(grads, inv) if unscale_now else scale.check_(grads)
        found.append(f if all_dropped is None else f + all_dropped)
    agree = None if state.dist is None else state.dist.start_consensus(found, dropped, state.steps)
    tel = state.telemetry
    if tel is not None and state.steps >= tel.next_sample:  # a gradient sample is due
        tel.on_grads(state.steps, not unscale_now)  # fused, no clip: grads still scaled
    spikes = state.spikes  # the flight recorder (ampguard.guard._spikes): grad norms, spike flag
    if spikes is not None:
        spikes.on_grads(state.steps, None if unscale_now else scale.inv_scale())
    grad_norm = clip(state, found, None if spikes is None else spikes.clip_parts())
    if agree is not None and state.dist is not None:  # agree implies dist
        found, dropped = agree.wait()
        grad_norm = state.dist.plain_tensor(grad_norm)  # FSDP2: a replicated DTensor
    spike = None if spikes is None else spikes.spike_flag()
    status = results.pack(found, dropped, state.loss_bad, spike)
    grad_scale = None if unscale_now else scale.scale_tensor
    n = len(found)
    skip_on = found if spikes is None else spikes.skip_found(found)  # a spike skips like found_inf
    if all(fused):  # no host sync (as torch): the kernels skip themselves on found_inf
        for opt, f in zip(state.optimizers, skip_on, strict=True):
            _fused_step(opt, f, grad_scale, kwargs)
        status = _update(state, status, found, dropped)
        if spikes is not None:
            spikes.on_status(state.steps, status, scale.scale_tensor if scale.scaled else None)
        if tel is not None:
            tel.on_step(state.steps, status, grad_norm)
        result = StepResult(state.steps, True, grad_norm, None, owner=owner)
        state.pending.append((result, status))
        return result
    status = _update(state, status, found, dropped)
    if spikes is not None:
        spikes.on_status(state.steps, status, scale.scale_tensor if scale.scaled else None)
    packed = int(status.item())  # the one sync (torch's GradScaler has it in step())
    if tel is not None:
        tel.on_step(state.steps, packed, grad_norm)
    flags = results.decode(packed, n, scaled=scale.scaled)
    for opt, f, ok, opt_fused in zip(
        state.optimizers, skip_on, flags.applied_per_optimizer, fused, strict=True
    ):
        if opt_fused:
            _fused_step(opt, f, None, kwargs)  # unscaled above: it only skips on found_inf
        elif ok:
            opt.step(**kwargs)
    result = StepResult(state.steps, True, grad_norm, flags)
    _flags.settle(state, state.steps, flags)
    return result


def _update(
    state: StepState,
    status: torch.Tensor,
    found: list[torch.Tensor],
    dropped: torch.Tensor | None,
) -> torch.Tensor:
    """Advance the loss scale by the window; its collapse flag joins ``status``. The no-op scale
    returns no flag: nothing runs. Cost: no host sync."""
    collapse = state.loss_scale.update_window(found, dropped)
    if state.loss_scale.scaled:
        state.history.record(state.steps, state.loss_scale.scale_tensor)
    if collapse is None:
        return status
    return results.add_collapse(status, collapse, len(found))


def _unchecked(
    state: StepState,
    kwargs: dict[str, Any],
    dropped: torch.Tensor | None,
    all_dropped: torch.Tensor | None,
) -> StepResult:
    """``skip_nonfinite=False`` without a scale: no check and no sync, except containment's (a
    window whose micro-batches were all dropped has zero gradients and must skip)."""
    n = len(state.optimizers)
    status = None if all_dropped is None else results.pack([all_dropped] * n, dropped)
    tel = state.telemetry
    if tel is not None and state.steps >= tel.next_sample:  # a gradient sample is due
        tel.on_grads(state.steps, False)
    grad_norm = clip(state, None)
    if state.dist is not None:
        grad_norm = state.dist.plain_tensor(grad_norm)  # FSDP2: a replicated DTensor
    packed = 0 if status is None else int(status.item())
    flags = results.decode(packed, n, scaled=False)
    if flags.applied:
        for opt in state.optimizers:
            opt.step(**kwargs)
    if tel is not None:
        tel.on_step(state.steps, packed, grad_norm)
    state.counts.record(flags)
    return StepResult(state.steps, True, grad_norm, flags)


def _fused_step(
    opt: torch.optim.Optimizer,
    found: torch.Tensor,
    grad_scale: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> None:
    # torch's fused Adam/AdamW/SGD unscale inside their kernel (grad_scale; None: the gradients
    # are unscaled already) and skip the update, undoing their step count, on found_inf.
    opt.grad_scale = grad_scale  # type: ignore[attr-defined]
    opt.found_inf = found  # type: ignore[attr-defined]
    try:
        opt.step(**kwargs)
    finally:
        del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]


def clip(
    state: StepState, found: list[torch.Tensor] | None, parts: list[torch.Tensor] | None = None
) -> torch.Tensor | None:
    """Clip the unscaled gradients to ``clip_grad_norm``; the total norm before clipping (None
    without clipping). ``parts``: the per-parameter norms the flight recorder already took (its
    ``clip_parts()``: the total is their 2-norm, bitwise torch's), so the gradients are read
    once. Cost: no host sync."""
    if state.clip_grad_norm is None:
        return None
    if parts is not None:
        total = torch.linalg.vector_norm(torch.stack(parts), 2.0)
    else:
        grads = [p.grad for p in state.params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
    safe = total
    if found is not None and len(found) > 1:
        # One optimizer's overflow must neither turn the others' gradients into NaN nor
        # leave them unclipped: they are clipped with the norm of the finite optimizers.
        safe = torch.where(torch.isfinite(total), total, _finite_norm(state))
    torch.nn.utils.clip_grads_with_norm_(state.params, state.clip_grad_norm, safe)
    return total


def _finite_norm(state: StepState) -> torch.Tensor:
    """Total grad norm over the optimizers whose own grads are finite. Cost: no sync."""
    sq = None
    for opt in state.optimizers:
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in params_of_optimizer(opt) if p.grad is not None]
        )
        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
        sq = norm * norm if sq is None else sq + norm * norm
    assert sq is not None
    return sq.sqrt()


def skip_flag(state: StepState, result: StepResult) -> bool | torch.Tensor:
    """Whether the window just stepped was skipped: a bool when its flags are on the host, else
    a 0-dim bool device tensor (fused optimizers' lazy flags). Cost: no host sync."""
    if state.pending and state.pending[-1][0] is result:
        return torch.remainder(state.pending[-1][1], 2 ** len(state.optimizers)) > 0
    return not result.applied
