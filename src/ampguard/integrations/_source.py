"""What ``ag.watch`` resolves once at attach: the telemetry source of a watched loop, its
precision, its run folder, and the one warning of an fp16 loop without a loss scale."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ampguard import precisions
from ampguard import telemetry as _telemetry
from ampguard._util.stack import user_stacklevel
from ampguard.core.policy import device_of
from ampguard.integrations._optim import params_of
from ampguard.integrations._policy import AttachPolicy
from ampguard.integrations._seam import ScalerInfo, ScaleView, WatchableScaler

__all__ = [
    "PRECISIONS",
    "WatchSource",
    "as_tensor",
    "refuse_engine",
    "resolve_precision",
    "resolve_telemetry",
    "warn_no_scaler",
]

PRECISIONS = precisions.names(watchable=True)


class WatchSource:
    """The :class:`ampguard.telemetry.source.TelemetrySource` of a watched loop: what
    :class:`ampguard.Telemetry` reads about a loop that ampguard observes but does not run.

    Fixed for the run (a watched loop has one precision and one scaler); the step numbers travel
    with the telemetry hooks. Cost: one host sync when made (the scale at attach time).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        scaler: WatchableScaler | None,
        precision: str,
        policy: AttachPolicy,
        framework: str | None,
    ) -> None:
        self.model = model
        self.optimizers = optimizers
        own = scaler.grad_params() if scaler is not None else None
        self.params = list(own) if own is not None else params_of(optimizers)
        self.device = device_of(self.params)
        self.precision = self.requested_precision = precision
        self.loss_scaler = (
            ScaleView(scaler, self.device) if scaler is not None and scaler.scaled else None
        )
        self.scaler_config = ScalerInfo(scaler, policy, framework)
        self.accumulation_steps = 1  # the loop's own accumulation is invisible: one per step
        self.clip_grad_norm: float | None = None
        self.contain_nonfinite_microbatches = False


def resolve_precision(precision: str | None, scaled: bool, framework_knows: bool = False) -> str:
    """The precision a watched loop computes in. ``framework_knows``: an integration that read
    its framework's settings names it (e.g. fp32 under an enabled scaler when Accelerate's
    autocast is off); a user's ``watch()`` call must agree with its scaler."""
    if precision is None:
        if not scaled:
            raise ValueError(
                "watch() without an enabled GradScaler needs precision='bf16' or "
                "'fp32' (the loop's autocast dtype)"
            )
        return "fp16"
    entry = precisions.get(precision, allowed=PRECISIONS)
    if scaled and not entry.needs_scaler and not framework_knows:
        raise ValueError(
            f"precision={precision!r} but the GradScaler is enabled (fp16 loss "
            "scaling); pass precision='fp16' or None"
        )
    return precision


def as_tensor(value: torch.Tensor | float | int, device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 tensor on ``device``: a tensor as it is (moved there), a host number by a
    fill (no sync)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device).float().reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


def resolve_telemetry(telemetry: Any) -> Any:
    if isinstance(telemetry, (str, os.PathLike)):
        return _telemetry.Telemetry(telemetry)
    if isinstance(telemetry, _telemetry.Telemetry):
        return telemetry
    raise TypeError(
        "telemetry must be a run folder path or an ampguard.Telemetry, got "
        f"{type(telemetry).__name__}"
    )


def warn_no_scaler(framework: str | None) -> None:
    """An fp16 loop with no loss scale: said once at attach, whatever its gradients turn out."""
    where = f"{framework}'s fp16 step" if framework else "this fp16 loop"
    warnings.warn(
        f"{where} has no loss scaler: gradients below fp16's smallest normal (6.1e-05) "
        "lose precision or flush to zero, and nothing skips a step that overflows. Use "
        "torch.amp.GradScaler (or ag.Guard(precision='fp16')), or train in bf16; AG171 "
        "reports a layer that loses its gradient",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def refuse_engine(*given: Any) -> None:
    """A DeepSpeed engine has its own entry point: it reads the engine's precision, scale and
    skips (checked by class name: this module never imports DeepSpeed)."""
    for obj in given:
        if any(
            c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed")
            for c in type(obj).__mro__
        ):
            raise TypeError(
                "ag.watch was given a DeepSpeedEngine: use "
                "ampguard.integrations.deepspeed.watch(engine, telemetry=...), which reads the "
                "engine's precision, loss scale, skips and grad norm"
            )
