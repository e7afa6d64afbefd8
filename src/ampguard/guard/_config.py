"""The Guard's arguments, checked in one place: :func:`check` -> a frozen :class:`GuardConfig`.

Step 1 of the Guard's all-or-nothing construction: every argument is checked (in the order the
Guard has always checked them, so the first bad one is the one named) before any resource is
created or the model is touched; what the checks derive (the optimizer list, the parameters,
the device, the resolved precision, the fp8 conversion plan...) is kept, grouped, in the config
that :mod:`ampguard.guard._parts` builds the Guard's parts from. Cost: no host sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ampguard.core import as_optimizers, check_flag, check_model, check_window
from ampguard.core.policy import PrecisionPolicy, check_parameters, device_of, resolve_precision
from ampguard.core.resume import ResumeWarmup
from ampguard.core.scaler import ScalerConfig
from ampguard.core.stagnation import StagnationProbe
from ampguard.distributed import check_distributed_options, resolve_peer_timeout
from ampguard.forensics import check_arguments as check_forensics_arguments
from ampguard.fp8 import Conversion
from ampguard.guard import _fp8, _recipe, _rescue, _signatures, _spikes
from ampguard.telemetry import check_argument as check_telemetry_argument

__all__ = ["GuardConfig", "arguments", "check"]


@dataclass(frozen=True, eq=False)
class GuardConfig:
    """The Guard's checked arguments and what the checks derived from them (read-only)."""

    # the training objects
    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    params: list[torch.Tensor]
    device: torch.device
    schedulers: list[Any]
    # the window and the step
    accumulation_steps: int
    clip_grad_norm: float | None
    skip_nonfinite: bool
    contain_microbatches: bool
    restore_buffers_on_skip: bool
    scaler: ScalerConfig  # the default one when scaler=None
    resume_warmup: ResumeWarmup | None
    # the precision: as requested, resolved, and its conversion hook (fp8; None otherwise)
    requested_precision: Any
    policy: PrecisionPolicy
    conversion: Conversion | None
    # the per-concern settings
    stagnation: StagnationProbe | None  # None when every trained parameter is fp32
    rescue: tuple[str | None, bool, list[Any]]  # stagnation_rescue, fp32 states, EMA watches
    audit_every: int | None
    on_desync: str
    process_group: Any
    peer_timeout: float
    telemetry: Any
    keep_fp32: Any
    forensics: bool
    auto_fallback: bool
    coverage_step: int | None
    spikes: _spikes.SpikeConfig | None
    signatures_every: int | None


def arguments(frame_locals: Mapping[str, Any]) -> dict[str, Any]:
    """The Guard constructor's arguments from its ``locals()`` at entry (``self`` left out)."""
    return {name: value for name, value in frame_locals.items() if name != "self"}


def check(
    model: torch.nn.Module,
    optimizer: Any,
    precision: Any,
    scaler: Any,
    accumulation_steps: Any,
    clip_grad_norm: Any,
    *,
    schedulers: Sequence[Any],
    contain_nonfinite_microbatches: Any,
    resume_warmup: Any,
    audit_every: Any,
    on_desync: Any,
    process_group: Any,
    peer_timeout: Any,
    telemetry: Any,
    keep_fp32: Any,
    forensics: Any,
    auto_fallback: Any,
    coverage_step: Any,
    fp8_plan: Any,
    skip_nonfinite: Any,
    restore_buffers_on_skip: Any,
    stagnation_rescue: Any,
    fp32_optimizer_states: Any,
    ema: Any,
    flight_recorder: Any,
    snapshot_every: Any,
    snapshot: Any,
    on_spike: Any,
    signatures: Any,
) -> GuardConfig:
    """Check every argument of ``Guard(...)`` (same names) and group them in a ``GuardConfig``.

    Raises the Guard's ``TypeError`` / ``ValueError`` naming the first bad argument; nothing is
    created, registered or changed before every argument passed. Cost: no host sync.
    """
    optimizers = as_optimizers(optimizer)
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    check_model(model, params)
    check_window(accumulation_steps, clip_grad_norm)
    skip_nonfinite = check_flag("skip_nonfinite", skip_nonfinite)
    # bf16/fp16 weights: the share of updates that round away (ampguard.core.stagnation)
    stagnation = StagnationProbe.of(model, params)
    rescue = _rescue.check(stagnation_rescue, fp32_optimizer_states, ema, model, optimizers)
    if scaler is not None and not isinstance(scaler, ScalerConfig):
        raise TypeError(f"scaler must be an ampguard.ScalerConfig, got {type(scaler).__name__}")
    # a skipped window's forward leaves no trace in the buffers (ampguard.core.buffer_restore)
    restore_buffers = check_flag("restore_buffers_on_skip", restore_buffers_on_skip)
    device = device_of(params)
    precision, fp8_plan = _recipe.split(precision, fp8_plan)  # a {layer: format} recipe
    policy = resolve_precision(precision, device)
    check_parameters(params, policy, argument="optimizer")
    # ampguard's own collectives wait at most peer_timeout seconds (None: the group's own
    # timeout when the user set one, else 10 min; ampguard.distributed._peers)
    peer_timeout = resolve_peer_timeout(peer_timeout, process_group)
    check_distributed_options(audit_every, on_desync)
    check_telemetry_argument(telemetry)
    check_forensics_arguments(model, keep_fp32, forensics, auto_fallback, coverage_step)
    spike_config = _spikes.check(
        flight_recorder, snapshot_every, snapshot, on_spike, optimizers, list(schedulers)
    )
    signatures_every = _signatures.check(signatures)
    # the precision's conversion hook (fp8: ampguard.fp8._convert): the plan checked,
    # torchao imported, the layers chosen; converted to torchao's Float8Linear in step 3
    conversion, policy = _fp8.attach(policy, precision, model, device, fp8_plan)
    return GuardConfig(
        model=model,
        optimizers=optimizers,
        params=params,
        device=device,
        schedulers=list(schedulers),
        accumulation_steps=accumulation_steps,
        clip_grad_norm=None if clip_grad_norm is None else float(clip_grad_norm),
        skip_nonfinite=skip_nonfinite,
        contain_microbatches=bool(contain_nonfinite_microbatches),
        restore_buffers_on_skip=restore_buffers,
        scaler=scaler or ScalerConfig(),
        resume_warmup=resume_warmup,
        requested_precision=precision,
        policy=policy,
        conversion=conversion,
        stagnation=stagnation,
        rescue=rescue,
        audit_every=audit_every,
        on_desync=on_desync,
        process_group=process_group,
        peer_timeout=peer_timeout,
        telemetry=telemetry,
        keep_fp32=keep_fp32,
        forensics=forensics,
        auto_fallback=auto_fallback,
        coverage_step=coverage_step,
        spikes=spike_config,
        signatures_every=signatures_every,
    )
