"""The Guard's step state: what its step, flag, collapse and state helpers read and change.

The Guard owns one :class:`StepState` and passes it to the helpers of this package (the one
step, the pending flags, the collapse policy, the non-finite bound, the state dict); its fields
are public so that no helper reaches into the Guard's private attributes. The wiring (model,
optimizers, telemetry, distributed state...) is set once when the Guard is built
(:mod:`ampguard.guard._parts`, from its checked arguments); the counters change every window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.core.buffer_restore import BufferSnapshot
from ampguard.core.containment import MicrobatchBuffer
from ampguard.core.loss_scale import LossScale, make_loss_scale
from ampguard.core.policy import PrecisionPolicy
from ampguard.core.results import Counters, StepResult
from ampguard.core.resume import ResumeTracker
from ampguard.core.scale_history import ScaleHistory
from ampguard.core.scaler import ScalerConfig
from ampguard.core.stagnation import StagnationProbe
from ampguard.distributed import DistributedState
from ampguard.forensics import SignatureRecorder
from ampguard.fp8 import Conversion
from ampguard.guard._forensics import GuardForensics
from ampguard.guard._rescue import GuardRescue
from ampguard.guard._spikes import SpikeWatch
from ampguard.telemetry import Telemetry

__all__ = ["StepState"]


@dataclass(eq=False)
class StepState:
    """The Guard's configuration, wiring and per-window counters (see the module docstring)."""

    # configuration (the constructor's checked arguments)
    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    params: list[torch.Tensor]
    device: torch.device
    config: ScalerConfig
    accumulation_steps: int
    clip_grad_norm: float | None
    skip_nonfinite: bool
    contain_microbatches: bool
    requested_precision: str
    # the precision now and its loss scale (both change on a fallback or a load)
    policy: PrecisionPolicy
    loss_scale: LossScale
    history: ScaleHistory
    resume: ResumeTracker  # the resume record and its warm-up ramp
    # what the Guard attached (None: not in use)
    telemetry: Telemetry | None = None
    dist: DistributedState | None = None
    forensics: GuardForensics | None = None
    fp8: Conversion | None = None
    rescue: GuardRescue | None = None  # stagnation_rescue / fp32_optimizer_states / ema
    spikes: SpikeWatch | None = None  # the flight recorder and on_spike (ampguard.guard._spikes)
    stagnation: StagnationProbe | None = None  # bf16/fp16 weights' lost updates (AG175)
    buffer_snapshot: BufferSnapshot | None = None  # restore_buffers_on_skip: the window's
    micro_snapshot: BufferSnapshot | None = None  # ... and, under containment, each micro-batch's
    signatures: SignatureRecorder | None = None  # signatures= (ampguard.guard._signatures)
    callbacks: list[Callable[[StepResult], Any]] = field(default_factory=list)  # on_applied
    # the counters
    steps: int = 0  # windows completed
    micro: int = 0  # micro-batches into the window in progress
    counts: Counters = field(default_factory=Counters)
    pending: list[tuple[StepResult, torch.Tensor]] = field(default_factory=list)  # fused flags
    fallback: dict[str, Any] | None = None
    collapsing: bool = False  # inside a warned collapse episode
    contain: MicrobatchBuffer | None = None
    loss_bad: torch.Tensor | None = None  # the window's losses were non-finite (device flag)
    window_losses: list[torch.Tensor] = field(default_factory=list)

    @property
    def scaled(self) -> bool:
        """True while a loss scale multiplies the loss (fp16, no fallback happened)."""
        return self.loss_scale.scaled

    def new_loss_scale(self) -> LossScale:
        """A fresh loss scale for the precision now (registry entry's ``loss_scale`` kind, from
        ``init_scale``). Cost: no host sync."""
        return make_loss_scale(self.policy.entry.loss_scale, self.config, self.device)
