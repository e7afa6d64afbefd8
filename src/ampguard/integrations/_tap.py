"""Non-invasive taps on a ``torch.amp.GradScaler`` instance.

:class:`ScalerTap` shadows the instance's ``scale``, ``unscale_``, ``step`` and ``update`` with thin
wrappers that call the originals with the same arguments and return their results. Before doing
so they *read* what the scaler already holds: the loss handed to ``scale``, the gradients before
``unscale_``/``step`` touch them, and the per-optimizer ``found_inf`` tensors right before
``update`` consumes them (for fused optimizers these are what the kernel used to skip itself,
which is why attach mode reports their skips correctly). Nothing the scaler or the optimizer
computes is changed; ``close`` removes the wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["ScalerTap", "TapListener", "is_grad_scaler", "is_watched", "scaler_stage"]

_METHODS = ("scale", "unscale_", "step", "update")
_MARK = "__ampguard_tap__"


class TapListener(Protocol):
    """What a tap reports to (the Watch)."""

    def on_scaler_loss(self, loss: torch.Tensor) -> None: ...

    def on_scaler_grads(self, optimizer: torch.optim.Optimizer) -> None: ...

    def on_scaler_update(
        self,
        found: dict[int, torch.Tensor],
        found_all: torch.Tensor,
        scale_before: torch.Tensor,
        manual: bool,
    ) -> None: ...


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

    def __init__(self, scaler: Any, listener: TapListener, watched: set[int]) -> None:
        if is_watched(scaler):
            raise ValueError(
                "scaler is already watched by ampguard; close() the other handle first"
            )
        self.scaler = scaler
        self.listener = listener
        self.watched = watched
        self.active = True
        self._seen: set[int] = set()  # optimizers whose gradients were observed this iteration
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
        return self._originals["step"](optimizer, *args, **kwargs)

    def _update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not (self.active and self.scaler.is_enabled()) or self.scaler._scale is None:
            return self._originals["update"](new_scale)  # torch raises its own error if unused
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
        self.listener.on_scaler_update(found, found_all, before, new_scale is not None)
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
        self.listener.on_scaler_grads(optimizer)  # the gradients still carry the scale


def _marked(method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    wrapper.__doc__ = method.__doc__
    return wrapper


def _sum_found(per_device: dict[Any, torch.Tensor], device: torch.device) -> torch.Tensor:
    values = [t.to(device, non_blocking=True) for t in per_device.values()]
    return torch.stack(values).sum() if len(values) > 1 else values[0].clone()
