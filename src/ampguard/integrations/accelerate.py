"""Accelerate: observe ``accelerator.scaler`` and ``optimizer_step_was_skipped`` without changing
the loop.

>>> accelerator = Accelerator(mixed_precision="fp16")
>>> model, optimizer, data = accelerator.prepare(model, optimizer, data)
>>> with watch_accelerator(accelerator, model, optimizer, telemetry="runs/exp1") as handle:
...     for x, y in data:
...         with accelerator.autocast():
...             loss = loss_fn(model(x), y)
...         accelerator.backward(loss)
...         optimizer.step()
...         optimizer.zero_grad()
>>> handle.report()

Accelerate decides "skipped" by whether ``optimizer.step`` was called under ``scaler.step``. A
fused optimizer's ``step`` is always called (its kernel skips itself on ``found_inf``), so
``optimizer_step_was_skipped`` stays False on skipped steps and the scheduler advances. ampguard
records skips from ``found_inf``, and reports every step where Accelerate's flag disagrees as
AG120. Nothing in Accelerate's own behaviour is changed.
"""

from __future__ import annotations

from typing import Any

import torch

from ampguard import precisions
from ampguard.guard import DEFAULT_CAPACITY
from ampguard.integrations._extras import require
from ampguard.integrations._findings import fp16_inactive
from ampguard.integrations._policy import AttachPolicy
from ampguard.integrations._recorder import RecorderOptions
from ampguard.integrations.watch import Watch

require("accelerate", "ampguard.integrations.accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402

__all__ = [
    "watch_accelerator",
    "observe_skip_flags",
    "accelerate_precision",
    "requested_precision",
]


def watch_accelerator(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    telemetry: Any,
    *,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    on_collapse: str = "warn",
    flight_recorder: int | bool = DEFAULT_CAPACITY,
    on_spike: str | None = "warn",
    snapshot_every: int | None = None,
    signatures: bool | int = False,
) -> Watch:
    """Attach ampguard to a prepared Accelerate loop; return the :class:`Watch` handle.

    ``model``/``optimizer``: what ``accelerator.prepare`` returned (one optimizer or a list).
    Records the scale and skips from ``accelerator.scaler`` under fp16, or every optimizer step
    under bf16/fp32, the loss given to ``accelerator.backward`` (before its division by the
    accumulation steps) and the unscaled gradient statistics. Guard options as in
    :func:`ampguard.watch` (fp16 only). ``flight_recorder``, ``on_spike``, ``snapshot_every``,
    ``signatures`` as in :func:`ampguard.watch`: a spike is skipped through
    ``accelerator.scaler`` (fp16) or the optimizer's step (bf16/fp32); either way
    ``optimizer_step_was_skipped`` is True for it, so a prepared scheduler does not advance.
    ``ampguard.triage(handle)`` needs the loop to hand each batch to ``handle.record_batch``.
    Cost: as :func:`ampguard.watch`.
    """
    if not hasattr(accelerator, "backward") or not hasattr(accelerator, "mixed_precision"):
        raise TypeError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    scaler = accelerator.scaler
    precision, note = accelerate_precision(
        accelerator.mixed_precision,
        scaler,
        accelerator.device,
        native_amp=getattr(accelerator, "native_amp", None),
    )
    handle = Watch(
        scaler,
        accelerator.unwrap_model(model),
        optimizer,
        telemetry,
        precision=precision,
        framework="accelerate",
        loss_from_scaler=False,
        policy=AttachPolicy(min_scale, max_scale, hysteresis, consecutive_hysteresis, on_collapse),
        requested_precision=requested_precision(accelerator.mixed_precision),
        recorder=RecorderOptions(flight_recorder, on_spike, snapshot_every, signatures),
    )
    if note is not None:
        handle.add_finding(note)
    _record_backward_loss(handle, accelerator)
    observe_skip_flags(handle, optimizer)
    return handle


def accelerate_precision(
    mixed_precision: str, scaler: Any, device: Any, *, native_amp: bool | None = None
) -> tuple[str, Any]:
    """The precision Accelerate really computes in for its ``mixed_precision`` setting, and an
    AG122 finding when fp16 was asked for but does not run.

    fp16 runs only with an enabled ``scaler`` *and* Accelerate's fp16 autocast: with
    ``native_amp=False`` (Accelerate on CPU, even when the user set ``accelerator.scaler``)
    ``accelerator.autocast()`` is a no-op, so the loss is scaled but every op is fp32: that is
    recorded as fp32 with AG122. ``native_amp=None``: not known (taken as on).
    """
    autocast = native_amp is not False
    asked = precisions.REGISTRY.get(requested_precision(mixed_precision))
    if asked is not None and asked.needs_scaler:
        if scaler is not None and scaler.is_enabled() and autocast:
            return asked.name, None
        if scaler is not None and scaler.is_enabled():
            detail = (
                f"accelerator.scaler is set, but native_amp is False on device {str(device)!r}: "
                "accelerator.autocast() adds no fp16 autocast, so the loss is scaled and every "
                "op runs in fp32"
            )
        else:
            detail = (
                f"Accelerate creates no GradScaler and no fp16 autocast on device {str(device)!r}"
            )
        return precisions.full(), fp16_inactive("accelerate", detail)
    if scaler is not None and scaler.is_enabled():
        # a scaler the user set under another setting: the loop is theirs
        return precisions.scaled(), None
    if asked is not None and not asked.is_full:
        return precisions.watched_as(asked.name), None  # fp8: attach mode sees its bf16 autocast
    return precisions.full(), None


# Accelerate's mixed_precision values -> ampguard's precisions (checked against the registry)
_ACCELERATE = precisions.checked(
    {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"},
    source="Accelerate's mixed_precision map",
)


def requested_precision(mixed_precision: Any) -> str:
    """ampguard's name for Accelerate's ``mixed_precision`` setting (what the user asked for)."""
    return _ACCELERATE.get(str(mixed_precision), str(mixed_precision))


def observe_skip_flags(handle: Watch, optimizer: Any) -> None:
    """After each real step of every ``AcceleratedOptimizer`` in ``optimizer``, hand its own
    ``step_was_skipped`` to ``handle`` (compared with ``found_inf`` in the findings: AG120).

    The optimizer's ``step`` is wrapped on the instance and called through unchanged; the wrapper
    is removed when ``handle`` closes. Cost: no host sync (the flag is a host bool).
    """
    opts = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in opts:
        if not isinstance(opt, AcceleratedOptimizer):
            continue
        if opt.scaler is not None:
            _wrap_step(handle, opt)
        elif handle.recorder is not None and handle.recorder.acts:
            _report_spike_skips(handle, opt)  # without a scaler Accelerate reports no skip


def _wrap_step(handle: Watch, opt: AcceleratedOptimizer) -> None:
    original = opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        before = handle.steps
        result = original(*args, **kwargs)
        if handle.steps != before:  # a real step (not an accumulation micro-batch)
            handle.note_framework_skip(opt.step_was_skipped)
        return result

    opt.__dict__["step"] = step
    handle.on_close(lambda: opt.__dict__.get("step") is step and opt.__dict__.pop("step"))


def _report_spike_skips(handle: Watch, opt: AcceleratedOptimizer) -> None:
    """Without a scaler, a step ampguard skipped for a loss spike (``on_spike="skip"``) is
    reported as skipped by ``step_was_skipped`` (Accelerate's own flag, which it sets only from
    its GradScaler), so a prepared scheduler (and the HF Trainer's) does not advance on it."""
    original = opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        opt._is_overflow = handle.spike_skipped_last
        return result

    opt.__dict__["step"] = step
    handle.on_close(lambda: opt.__dict__.get("step") is step and opt.__dict__.pop("step"))


def _record_backward_loss(handle: Watch, accelerator: Any) -> None:
    original = accelerator.backward

    def backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        handle.record_loss(loss)
        return original(loss, **kwargs)

    accelerator.__dict__["backward"] = backward
    handle.on_close(
        lambda: (
            accelerator.__dict__.get("backward") is backward
            and accelerator.__dict__.pop("backward")
        )
    )
