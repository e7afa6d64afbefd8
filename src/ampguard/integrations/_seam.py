"""The seam of attach mode: what ``ag.watch`` needs from a loss scaler it observes.

:class:`~ampguard.integrations.watch.Watch` never asks *which* scaler it watches. It asks a
:class:`WatchableScaler` four things, each answered from what the scaler already holds:

* **the scale**, without a host sync: :meth:`WatchableScaler.scale` returns a device tensor
  updated in place (``torch.amp.GradScaler``) or a host float (DeepSpeed's loss scaler);
  :class:`ScaleView` turns either into the :class:`~ampguard.telemetry.source.ScaleSource`
  that :class:`ampguard.Telemetry` reads every step;
* **whether the step was skipped**: the scaler's hooks hand a :class:`StepOutcome` to the
  listener (the Watch) when a step is over, with the overflow flags the scaler itself acted on
  (device tensors, or host bools where the scaler had already read them), so learning the
  skip costs no extra sync;
* **the unscale**: the hooks tell the listener when the gradients are final and whether they
  still carry the scale (``on_scaler_grads(scaled)``), so per-layer gradient telemetry is
  unscaled by the scale the step used;
* **its state for the report**: :meth:`WatchableScaler.describe` (``meta.json`` ``scaler``,
  which the rules and the report read), in ampguard's names (``init_scale``,
  ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``min_scale``, ``hysteresis``).

Implementations: ``torch.amp.GradScaler`` (:mod:`ampguard.integrations._tap`), DeepSpeed's loss
scaler and engine (:mod:`ampguard.integrations.deepspeed`). An integration
with its own scaler is one new file implementing the protocol: it hands its object to ``Watch``
directly, or names a factory in :data:`ADAPTERS` (keyed by the top-level package of the
scaler's class) so that ``ag.watch(its_scaler, ...)`` finds it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "ADAPTERS",
    "NOT_MINE",
    "ScaleView",
    "ScalerInfo",
    "ScalerListener",
    "StepOutcome",
    "WatchableScaler",
    "adapt",
]

# Top-level package of a scaler's class (or of a base class) -> "module:factory". A factory takes
# the object and returns a WatchableScaler, or None for one that is present but disabled (no loss
# scale and no step events: the Watch then records steps from the optimizer's hooks). Entries are
# imported on first use, so an optional framework is imported only for its own objects.
ADAPTERS: dict[str, str] = {
    "torch": "ampguard.integrations._tap:watchable",
    "deepspeed": "ampguard.integrations.deepspeed:watchable",
}


@dataclass(frozen=True)
class StepOutcome:
    """What a watched scaler reports when an optimizer step is over.

    ``found``: per watched optimizer (by ``id``), nonzero/True where the step was skipped for
    non-finite (scaled) gradients: 0-dim device tensors, or host bools the scaler had already
    read. ``found_all``: the combined flag the scaler's update acted on. ``scale_before``: the
    scale the step used. ``manual``: the scale was set by hand (``update(new_scale)``), so the
    attach-mode guard features stay out. ``grad_norm``: the unscaled total gradient norm where
    the engine computed one (else None). ``nonfinite``: a 0-dim device flag, nonzero where the
    step was *applied* with non-finite gradients (an engine that does not skip them), or None.
    """

    found: Mapping[int, torch.Tensor | bool]
    found_all: torch.Tensor | bool
    scale_before: torch.Tensor | float
    manual: bool = False
    grad_norm: torch.Tensor | float | None = None
    nonfinite: torch.Tensor | None = None


class ScalerListener(Protocol):
    """What a watched scaler reports to (the Watch). Every call is on the hot path: no sync."""

    def on_scaler_loss(self, loss: torch.Tensor) -> None:
        """The unscaled loss handed to the scaler (one element, detached)."""
        ...

    def on_scaler_grads(self, scaled: bool) -> None:
        """The gradients of this step are final and not yet unscaled (``scaled``: they carry the
        scale; False where no loss scale is in use)."""
        ...

    def on_scaler_update(self, outcome: StepOutcome) -> None:
        """The step is over (applied or skipped) and the scale updated."""
        ...

    def on_scaler_step(self, optimizer: Any) -> torch.Tensor | None:
        """The scaler is about to step ``optimizer`` (its gradients final): a 0-dim device
        flag that makes it skip the step (a loss spike, ``on_spike="skip"``), or None. A scaler
        that can skip (:attr:`WatchableScaler.cannot_skip` is None) asks; others never do."""
        ...


@runtime_checkable
class WatchableScaler(Protocol):
    """A loss scaler ``ag.watch`` can observe without changing a number."""

    @property
    def name(self) -> str:
        """What it is, for messages and ``meta.json`` (e.g. ``"GradScaler"``)."""
        ...

    @property
    def scaled(self) -> bool:
        """A loss scale multiplies the loss (fp16). False: the scale is 1 (bf16/fp32) but the
        hooks still report every step (an engine that owns the step)."""
        ...

    @property
    def watched(self) -> bool:
        """True while a Watch observes it (a second one is refused)."""
        ...

    @property
    def correctable(self) -> bool:
        """The attach-mode floor, cap and hysteresis can act on it (:meth:`guard_tensors`)."""
        ...

    # Optional (read with getattr; absent means "cannot"): ``cannot_skip``, None where the
    # scaler skips a step on :meth:`ScalerListener.on_scaler_step`'s flag, else a sentence
    # saying why it cannot (``on_spike="skip"`` then warns, naming it).

    def scale(self) -> torch.Tensor | float:
        """The scale now: a device tensor updated in place, or a host float. No sync."""
        ...

    def grad_params(self) -> Sequence[torch.Tensor] | None:
        """The tensors whose ``.grad`` the telemetry samples (an engine with master weights names
        the model's parameters), or None: the optimizers' parameters."""
        ...

    def attach(self, listener: ScalerListener, watched: set[int]) -> None:
        """Install the hooks; report to ``listener`` for the optimizers whose ``id`` is in
        ``watched``."""
        ...

    def detach(self) -> None:
        """Remove the hooks (idempotent)."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready settings for the run log, with ``init_scale`` (the scale at attach).
        Called once at attach; may sync once."""
        ...

    def guard_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(scale, growth tracker)``: the scaler's own device tensors that the guard features
        correct in place after its update; ``None`` for a scaler that keeps its own floor and
        hysteresis (not :attr:`correctable`)."""
        ...


def adapt(scaler: Any) -> WatchableScaler | None:
    """The :class:`WatchableScaler` for what the user handed ``watch()``.

    ``None`` stays None (a loop without a scaler); an object that implements the protocol is used
    as it is; anything else goes to the factory of :data:`ADAPTERS` registered for its class's
    package (or a base class's), which may return None for a disabled scaler. ``TypeError``
    naming the argument otherwise.
    """
    if scaler is None:
        return None
    if isinstance(scaler, WatchableScaler):
        return scaler
    for cls in type(scaler).__mro__:
        target = ADAPTERS.get(cls.__module__.partition(".")[0])
        if target is None:
            continue
        found = _factory(target)(scaler)
        if found is not NOT_MINE:
            return found
    raise TypeError(
        "scaler must be a torch.amp.GradScaler (or subclass), another scaler ampguard has an "
        "adapter for (ampguard.integrations._seam.ADAPTERS), an object implementing "
        f"ampguard.integrations._seam.WatchableScaler, or None, got {type(scaler).__name__}"
    )


NOT_MINE: Any = object()
"""What a factory of :data:`ADAPTERS` returns for an object of its package that it does not
adapt (another class of that package): :func:`adapt` then tries the next base class."""


def _factory(target: str) -> Callable[[Any], Any]:
    module, _, attribute = target.partition(":")
    factory: Callable[[Any], Any] = getattr(importlib.import_module(module), attribute)
    return factory


class ScaleView:
    """A watched scaler's scale, shaped like :class:`ampguard.LossScaler` for Telemetry.

    A tensor scale is handed through (updated in place by its scaler). A float scale is mirrored
    into a one-element fp32 tensor on ``device``, rewritten in place whenever it is read with a
    new value: a fill from a host float, no sync.
    """

    def __init__(self, scaler: WatchableScaler, device: torch.device) -> None:
        self._scaler = scaler
        self._device = device
        self._mirror: torch.Tensor | None = None
        self._mirrored: float | None = None

    @property
    def scale_tensor(self) -> torch.Tensor:
        value = self._scaler.scale()
        if isinstance(value, torch.Tensor):
            return value
        value = float(value)
        if self._mirror is None:
            self._mirror = torch.full((1,), value, dtype=torch.float32, device=self._device)
        elif value != self._mirrored:
            self._mirror.fill_(value)
        self._mirrored = value
        return self._mirror

    def inv_scale(self) -> torch.Tensor:
        return self.scale_tensor.double().reciprocal().float()


class ScalerInfo:
    """What the run log says about an attached scaler (``meta.json`` ``scaler``).

    Cost: whatever :meth:`WatchableScaler.describe` costs (one sync for a tensor scale).
    """

    def __init__(self, scaler: WatchableScaler | None, policy: Any, framework: str | None) -> None:
        self._data: dict[str, Any] = {"mode": "attach", "framework": framework or "plain"}
        self.init_scale = 1.0
        if scaler is not None and scaler.scaled:
            described = scaler.describe()
            self.init_scale = float(described["init_scale"])
            self._data.update(scaler_class=scaler.name, **described)
            if scaler.correctable:
                # unset guard features are left out: the rules then use their defaults
                self._data.update({k: v for k, v in policy.to_dict().items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)
