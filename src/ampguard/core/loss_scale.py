"""The loss scale as one interface: the Guard's step never asks whether there is a scaler.

Three implementations of :class:`LossScale`, picked by a precision's registry entry
(``Precision.loss_scale``) and the :class:`~ampguard.ScalerConfig`:

=================  =========================================================================
``"none"``         :class:`NoOpLossScale` (bf16, fp32, fp8): the loss is not multiplied, the
                   "unscale" is the non-finite check alone (the gradients are read, never
                   changed), the update is nothing at all: no tensor, no kernel, no sync.
``"static"``       :class:`StaticLossScale`: a fixed scale (``init_scale``); overflowing
                   windows still skip, the scale never moves (``ScalerConfig(dynamic=False)``).
``"dynamic"``      :class:`~ampguard.LossScaler` (fp16): torch-identical growth and backoff
                   plus floor, cap and hysteresis.
=================  =========================================================================

Every method is device-side (no host sync) except ``scale()`` and ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from ampguard.core.scaler import LossScaler, ScaledLossScale, ScalerConfig

__all__ = [
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "KINDS",
    "check_grads",
    "make_loss_scale",
]

KINDS = ("none", "static", "dynamic")


class LossScale(Protocol):
    """What the Guard's step needs from a loss scale (see the module docstring)."""

    @property
    def scaled(self) -> bool:
        """True when the loss is multiplied by a scale (gradients must be unscaled)."""
        ...

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The live fp32 scale (0-dim, on the device). No sync."""
        ...

    def scale(self) -> float:
        """The scale as a Python float. Cost: one host sync where there is a scale."""
        ...

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a 0-dim fp32 device tensor. No sync."""
        ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on. No sync."""
        ...

    def unscale_(
        self, grads: Iterable[torch.Tensor], inv_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Unscale ``grads`` in place; the 0-dim fp32 non-finite flag. No sync."""
        ...

    def check_(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """The non-finite flag of ``grads`` without changing them. No sync."""
        ...

    def update_window(
        self, found: Sequence[torch.Tensor], dropped: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Advance the scale by one window; the 0-dim bool collapse flag, or None where the
        scale cannot collapse. No sync."""
        ...

    def fill_(self, scale: float) -> None:
        """Set the scale. No sync."""
        ...

    def state_dict(self) -> dict[str, Any] | None:
        """The scale's state (None: nothing to save). Cost: one host sync where there is a
        scale."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        ...


def check_grads(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-dim fp32 flag, nonzero when any of ``grads`` holds a NaN or inf. Cost: no host sync.

    torch's fused AMP check with ``inv_scale=1``: one multi-tensor pass per (device, dtype)
    group; multiplying by exactly 1.0 leaves every gradient bitwise as it was.
    """
    found = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group in groups.items():
        local = found if dev == found.device else torch.zeros((), dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, local, torch.ones((), dtype=torch.float32, device=dev)
        )
        if local is not found:
            found.add_(local.to(device))
    return found


class NoOpLossScale:
    """No loss scale (bf16, fp32, fp8): nothing multiplies the loss and nothing is updated.

    ``unscale_`` and ``check_`` are the non-finite check (:func:`check_grads`: the same fused
    pass as fp16's unscale, with 1.0), so a window with non-finite gradients is still seen.
    Cost: no host sync; no kernel at all outside the check.
    """

    scaled = False

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)  # made once

    @property
    def scale_tensor(self) -> torch.Tensor:
        return self._one

    def scale(self) -> float:
        """1.0. Cost: no host sync."""
        return 1.0

    def inv_scale(self) -> torch.Tensor:
        return self._one

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(
        self, grads: Iterable[torch.Tensor], inv_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        return check_grads(grads, self.device)

    def check_(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        return check_grads(grads, self.device)

    def update_window(
        self, found: Sequence[torch.Tensor], dropped: torch.Tensor | None
    ) -> torch.Tensor | None:
        return None  # no scale to back off, so no collapse (the non-finite bound counts skips)

    def fill_(self, scale: float) -> None:
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class StaticLossScale(ScaledLossScale):
    """A fixed loss scale: ``init_scale`` multiplies the loss, an overflowing window skips, and
    the scale never moves (nothing is updated, no collapse). A sibling of the dynamic
    :class:`~ampguard.LossScaler` (both are :class:`~ampguard.core.scaler.ScaledLossScale`): its
    state has the same fields. Cost: as the dynamic scale, minus the update kernels."""

    def update_window(
        self, found: Sequence[torch.Tensor], dropped: torch.Tensor | None
    ) -> torch.Tensor | None:
        return None


def make_loss_scale(kind: str, config: ScalerConfig, device: torch.device) -> LossScale:
    """The loss scale of a registry entry's ``loss_scale`` kind (``"dynamic"`` with
    ``ScalerConfig(dynamic=False)`` is static). ``ValueError`` for an unknown kind."""
    if kind == "none":
        return NoOpLossScale(device)
    if kind == "static" or (kind == "dynamic" and not config.dynamic):
        return StaticLossScale(config, device)
    if kind == "dynamic":
        return LossScaler(config, device)
    raise ValueError(f"loss_scale must be one of {KINDS}, got {kind!r}")
