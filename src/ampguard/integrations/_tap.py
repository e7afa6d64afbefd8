"""``torch.amp.GradScaler`` as a :class:`~ampguard.integrations._seam.WatchableScaler`.

:class:`TorchScaler` is the seam's implementation for torch's scaler (and its subclasses: the
sharded and ``cuda.amp`` ones). Its :class:`ScalerTap` shadows the instance's ``scale``,
``unscale_``, ``step`` and ``update`` with thin wrappers that call the originals with the same
arguments and return their results. Before doing so they *read* what the scaler already holds:
the loss handed to ``scale``, the gradients before ``unscale_``/``step`` touch them, and the
per-optimizer ``found_inf`` tensors right before ``update`` consumes them (for fused optimizers
these are what the kernel used to skip itself, which is why attach mode reports their skips
correctly). Nothing the scaler or the optimizer computes is changed; ``close`` removes the
wrappers.

The scale and growth tracker are the scaler's private ``_scale`` / ``_growth_tracker`` tensors:
torch has no public accessor that does not sync (``get_scale()`` reads the scale to the host).
They are read here and nowhere else in ampguard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ampguard.integrations import _skip
from ampguard.integrations._seam import NOT_MINE, ScalerListener, StepOutcome

__all__ = [
    "ScalerTap",
    "TorchScaler",
    "is_grad_scaler",
    "is_watched",
    "scaler_stage",
    "watchable",
]

_METHODS = ("scale", "unscale_", "step", "update")
_MARK = "__ampguard_tap__"


def watchable(scaler: Any) -> Any:
    """The seam's factory for torch objects: a :class:`TorchScaler` for an enabled
    ``GradScaler``, None for a disabled one (the loop has no loss scale), ``NOT_MINE`` for any
    other torch object."""
    methods = all(callable(getattr(scaler, m, None)) for m in (*_METHODS, "is_enabled"))
    if methods and not scaler.is_enabled():
        return None  # a disabled GradScaler only calls through: the loop has no loss scale
    return TorchScaler(scaler) if is_grad_scaler(scaler) else NOT_MINE


class TorchScaler:
    """A ``torch.amp.GradScaler`` seen through the seam (see the module docstring)."""

    correctable = True  # floor, cap and hysteresis correct _scale / _growth_tracker in place
    scaled = True
    cannot_skip = None  # a loss spike is folded into the scaler's found_inf (integrations._skip)

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self._tap: ScalerTap | None = None

    @property
    def name(self) -> str:
        return type(self.scaler).__name__

    @property
    def watched(self) -> bool:
        return is_watched(self.scaler)

    def scale(self) -> torch.Tensor | float:
        """The live scale tensor (``_init_scale`` before the first ``scale()`` made it). No
        sync."""
        scale = self.scaler._scale
        return float(self.scaler._init_scale) if scale is None else scale

    def grad_params(self) -> Sequence[torch.Tensor] | None:
        return None  # the optimizers' parameters hold the scaled gradients

    def attach(self, listener: ScalerListener, watched: set[int]) -> None:
        self._tap = ScalerTap(self.scaler, listener, watched)

    def detach(self) -> None:
        if self._tap is not None:
            self._tap.close()
            self._tap = None

    def describe(self) -> dict[str, Any]:
        """Settings and the scale at attach. Cost: one host sync (reads the scale)."""
        scaler = self.scaler
        scale = scaler._scale
        return {
            # the scale at attach time: the run log's first "scale before"
            "init_scale": float(scale.item()) if scale is not None else float(scaler._init_scale),
            "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
            "growth_interval": scaler.get_growth_interval(),
        }

    def guard_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.scaler._scale, self.scaler._growth_tracker


def is_grad_scaler(obj: Any) -> bool:
    """Duck-typed: a ``torch.amp.GradScaler`` (or subclass: sharded, cuda.amp)."""
    return all(callable(getattr(obj, m, None)) for m in _METHODS) and hasattr(
        obj, "_per_optimizer_states"
    )


def scaler_stage(scaler: Any, optimizer: torch.optim.Optimizer) -> str:
    """``"READY"``, ``"UNSCALED"`` or ``"STEPPED"`` for ``optimizer`` in this iteration.

    Reads the state without creating it (the scaler's defaultdict is never indexed).
    """
    state = scaler._per_optimizer_states.get(id(optimizer))
    return "READY" if state is None else state["stage"].name


def is_watched(scaler: Any) -> bool:
    """True while an open :class:`ScalerTap` wraps ``scaler``."""
    return any(getattr(scaler.__dict__.get(m), _MARK, False) for m in _METHODS)


class ScalerTap:
    """Wraps one scaler instance's methods; reports to ``listener`` for the optimizers in
    ``watched`` (ids of unwrapped optimizers)."""

    def __init__(self, scaler: Any, listener: ScalerListener, watched: set[int]) -> None:
        if is_watched(scaler):
            raise ValueError(
                "scaler is already watched by ampguard; close() the other handle first"
            )
        self.scaler = scaler
        self.listener = listener
        self.watched = watched
        self.active = True
        self._seen: set[int] = set()  # optimizers whose gradients were observed this iteration
        self._folded: list[Any] = []  # spike flags added to found_inf this iteration (_skip)
        self._originals = {m: getattr(scaler, m) for m in _METHODS}
        self._installed: dict[str, Callable[..., Any]] = {}
        for name, wrapper in (
            ("scale", self._scale),
            ("unscale_", self._unscale),
            ("step", self._step),
            ("update", self._update),
        ):
            marked = _marked(wrapper)
            scaler.__dict__[name] = marked
            self._installed[name] = marked

    def close(self) -> None:
        """Remove the wrappers (where nobody has wrapped them again since)."""
        self.active = False
        for name, wrapper in self._installed.items():
            if self.scaler.__dict__.get(name) is wrapper:
                del self.scaler.__dict__[name]
        self._installed.clear()

    # -- wrappers: observe, then call the original with the same arguments ---------------------
    def _scale(self, outputs: Any) -> Any:
        result = self._originals["scale"](outputs)
        if self.active and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            self.listener.on_scaler_loss(outputs.detach())
        return result

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self._observe(optimizer)
        return self._originals["unscale_"](optimizer)

    def _step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._observe(optimizer)
        flag = self._spike(optimizer)
        if flag is None:
            return self._originals["step"](optimizer, *args, **kwargs)
        folded = _skip.fold(self.scaler, optimizer, flag)  # the scaler skips it like an overflow
        try:
            return self._originals["step"](optimizer, *args, **kwargs)
        finally:
            if isinstance(folded, tuple):
                self._folded.append(folded)  # taken out before update(): the scale stays
            else:
                _skip.unfold(folded)

    def _spike(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The listener's flag that skips this step (a loss spike), or None."""
        ask = getattr(self.listener, "on_scaler_step", None)
        if not (self.active and self.scaler.is_enabled() and callable(ask)):
            return None
        if id(optimizer) not in self.watched or scaler_stage(self.scaler, optimizer) == "STEPPED":
            return None
        flag: torch.Tensor | None = ask(optimizer)
        return flag

    def _update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not (self.active and self.scaler.is_enabled()) or self.scaler._scale is None:
            return self._originals["update"](new_scale)  # torch raises its own error if unused
        while self._folded:  # a spike skipped a step: the scale moves on the overflow alone
            _skip.unfold(self._folded.pop())
        states = self.scaler._per_optimizer_states
        # torch adds the found_inf tensors up *in place* into the first one, so read them first.
        per_opt = {
            key: _sum_found(state["found_inf_per_device"], self.scaler._scale.device)
            for key, state in states.items()
            if state["found_inf_per_device"]
        }
        found_all = (
            torch.stack(list(per_opt.values())).sum()
            if per_opt
            else torch.zeros((), device=self.scaler._scale.device)
        )
        before = self.scaler._scale.clone()
        result = self._originals["update"](new_scale)
        self._seen.clear()
        found = {k: v for k, v in per_opt.items() if k in self.watched}
        self.listener.on_scaler_update(
            StepOutcome(found, found_all, before, manual=new_scale is not None)
        )
        return result

    def _observe(self, optimizer: torch.optim.Optimizer) -> None:
        scaler = self.scaler
        if not (self.active and scaler.is_enabled() and id(optimizer) in self.watched):
            return
        if (
            id(optimizer) in self._seen
            or scaler._scale is None
            or scaler_stage(scaler, optimizer) != "READY"
        ):
            return  # already unscaled (or stepped) this iteration: observed then
        self._seen.add(id(optimizer))
        self.listener.on_scaler_grads(True)  # the gradients still carry the scale


def _marked(method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    wrapper.__doc__ = method.__doc__
    return wrapper


def _sum_found(per_device: dict[Any, torch.Tensor], device: torch.device) -> torch.Tensor:
    values = [t.to(device, non_blocking=True) for t in per_device.values()]
    return torch.stack(values).sum() if len(values) > 1 else values[0].clone()
