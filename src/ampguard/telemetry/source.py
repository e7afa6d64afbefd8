"""The contract between :class:`ampguard.Telemetry` and the training loop it records.

Two sides, both public:

* **What Telemetry reads** from the object it observes (a :class:`ampguard.Guard`, or the
  attach-mode source of :func:`ampguard.watch`): :class:`TelemetrySource`. Telemetry reads the
  static members once at attach (the model, its parameters, the device, the optimizers and the
  configuration recorded in ``meta.json``), and ``precision`` and ``loss_scaler`` at attach and
  again after :meth:`Telemetry.on_fallback` and :meth:`Telemetry.on_resume`. Both may change
  during a run (a collapse fallback drops the scaler, a load may change the precision or replace
  the scaler): the producer reports every such change through one of these two hooks. The
  scaler's live ``scale_tensor`` is read every step.
* **What the producer tells Telemetry**, in this order per accumulation window: the producer
  side of the contract is :meth:`Telemetry.on_backward` (every micro-batch),
  :meth:`Telemetry.on_grads` (the window's gradients are final; may be skipped while the
  step is below :attr:`Telemetry.next_sample`, when nothing would be sampled),
  :meth:`Telemetry.on_step` (the
  optimizer step and scale update are done), or :meth:`Telemetry.on_abort` (the window ended
  without a step); and, outside the hot path, :meth:`Telemetry.on_fallback` and
  :meth:`Telemetry.on_resume`. The step number travels with the hooks, so Telemetry never reads
  or writes the producer's step counter; :meth:`Telemetry.on_resume` returns the step count the
  run continues from, which the producer applies.

Telemetry never writes to the source.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["ScaleSource", "ScalerDescription", "TelemetrySource"]


@runtime_checkable
class ScaleSource(Protocol):
    """The live loss scale (:class:`ampguard.LossScaler`, or, in attach mode, the scale of any
    watched scaler: :class:`ampguard.integrations._seam.ScaleView` hands a tensor scale through
    and mirrors a host-float scale, such as DeepSpeed's, into a device tensor)."""

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale as a one-element fp32 device tensor, updated in place. No sync."""
        ...

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a device tensor. No sync."""
        ...


@runtime_checkable
class ScalerDescription(Protocol):
    """What the run log records about the scaler (:class:`ampguard.ScalerConfig`, or
    :class:`ampguard.integrations._seam.ScalerInfo`: the attach-mode description any watched
    scaler gives, in ampguard's names)."""

    @property
    def init_scale(self) -> float:
        """The scale a run (or a scale reset) starts from."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (``meta.json`` ``scaler``)."""
        ...


@runtime_checkable
class TelemetrySource(Protocol):
    """What :class:`ampguard.Telemetry` reads from the loop it records.

    Implemented by :class:`ampguard.Guard` and by
    :class:`ampguard.integrations.watch.WatchSource`. Members are read-only for Telemetry; none
    may sync the host.
    """

    @property
    def model(self) -> torch.nn.Module:
        """The trained model (``meta.json``: class and parameter count)."""
        ...

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """The optimizers, in step order (their number packs the per-step flags)."""
        ...

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters the optimizers update, in optimizer order (gradient statistics)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the parameters live (the telemetry buffers go there)."""
        ...

    @property
    def precision(self) -> str:
        """The precision now (a name in ``ampguard.precisions.REGISTRY``). Read at attach,
        on_fallback and on_resume."""
        ...

    @property
    def requested_precision(self) -> str:
        """The precision asked for (``meta.json``; may be "auto")."""
        ...

    @property
    def loss_scaler(self) -> ScaleSource | None:
        """The live loss scale, or None when no scaler is in use. Read at attach, on_fallback and
        on_resume (its ``scale_tensor`` every step)."""
        ...

    @property
    def scaler_config(self) -> ScalerDescription:
        """The scaler's settings (``meta.json`` ``scaler``; ``init_scale`` on a reset)."""
        ...

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        ...

    @property
    def clip_grad_norm(self) -> float | None:
        """The gradient-norm clip, or None."""
        ...

    @property
    def contain_nonfinite_microbatches(self) -> bool:
        """Whether non-finite micro-batches are dropped from their window."""
        ...
