"""Preserve a model's parameters, buffers, gradients, RNG and training modes around replays.

A replay (``ampguard.locate``'s runs, the fix check, the autocast census, the spike autopsy)
runs the same batch several times from the same starting point; :class:`Preserved` puts the
values back between runs and everything, gradients included, back afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

from ampguard.replay._rng import rng_state as _rng_state
from ampguard.replay._rng import set_rng_state as _set_rng_state

__all__ = ["Preserved"]


class Preserved:
    """Snapshot of a model's parameters, buffers, grads, RNG and modes; :meth:`reset` restores
    the values for the next run, :meth:`close` restores everything and drops the copies.

    Cost: holds one copy of the parameters and buffers while open.
    """

    def __init__(self, model: torch.nn.Module, rng: dict[str, Any] | None = None) -> None:
        self.model = model
        self._slots: list[tuple[dict, str, torch.Tensor, torch.Tensor]] = []
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for key, value in store.items():
                    if value is not None:
                        self._slots.append((store, key, value, value.detach().clone()))
        self._grads = [(p, p.grad) for p in model.parameters()]
        self._modes = [(m, m.training) for m in model.modules()]
        self._device_type = next((p.device.type for p in model.parameters()), "cpu")
        self._rng = _rng_state(self._device_type)
        # the replays start from ``rng`` (the failing step's, so dropout draws the same mask);
        # close() puts back the RNG as it was when the snapshot was taken
        self._replay_rng = self._rng if rng is None else rng
        self.off: set[int] = set()  # ids of modules the next replays run in eval mode

    def reset(self) -> None:
        """Values, modes and RNG (the replay's: ``rng`` if given) as at the snapshot; gradients
        cleared (``None``)."""
        with torch.no_grad():
            # always copy back: kernels update buffers (BatchNorm stats) without a version bump
            for store, key, original, copy in self._slots:
                store[key] = original
                original.copy_(copy)
        for p, _ in self._grads:
            p.grad = None
        for m, mode in self._modes:
            m.training = mode and id(m) not in self.off
        _set_rng_state(self._device_type, self._replay_rng)

    def close(self) -> None:
        """Restore everything, gradients and the caller's RNG included, and free the copies."""
        self.off = set()
        self.reset()
        _set_rng_state(self._device_type, self._rng)
        for p, grad in self._grads:
            p.grad = grad
        self._slots.clear()
