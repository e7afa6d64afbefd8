"""Precision policy: resolve a precision request against a device.

``"auto"`` picks bf16 where the device supports bf16 autocast, else fp16. What each precision
means (autocast dtype, loss scale, parameter rules, conversion hook) is its entry in
:data:`ampguard.precisions.REGISTRY`; a :class:`PrecisionPolicy` is one entry bound to a
device type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ampguard import precisions as _registry
from ampguard.precisions import Precision

__all__ = [
    "PRECISIONS",
    "PrecisionPolicy",
    "resolve_precision",
    "supports_bf16",
    "device_of",
    "dtype_of",
    "check_parameters",
]

PRECISIONS = _registry.requests()  # "auto" and every registered precision


def dtype_of(name: str | None) -> torch.dtype | None:
    """The torch dtype a registry entry names (``None`` stays ``None``: full precision)."""
    return None if name is None else getattr(torch, name)


def supports_bf16(device_type: str) -> bool:
    """Whether bf16 autocast is usable on ``device_type`` (no host sync)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type in ("cpu", "xpu", "hpu"):
        return True
    if device_type == "mps":
        return torch.backends.mps.is_available()
    return False


@dataclass(frozen=True)
class PrecisionPolicy:
    """A resolved precision: its name, the device type and autocast dtype, and scaler need."""

    precision: str  # a name in ampguard.precisions.REGISTRY
    device_type: str

    @property
    def entry(self) -> Precision:
        """The registry entry of this precision."""
        return _registry.REGISTRY[self.precision]

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype, or ``None`` where autocast is off (fp32)."""
        return dtype_of(self.entry.autocast_dtype)

    @property
    def needs_scaler(self) -> bool:
        """True where gradients underflow without a loss scale (fp16)."""
        return self.entry.needs_scaler

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """An autocast context for this policy; a no-op context under fp32."""
        if self.dtype is None or not enabled:
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(self.device_type, dtype=self.dtype)


def resolve_precision(request: str, device: torch.device | str) -> PrecisionPolicy:
    """Resolve ``request`` (``"auto"`` or a registered precision) for ``device``.

    Raises ``ValueError`` naming ``precision`` for an unknown request or a bf16-based precision
    on a device without bf16 autocast.
    """
    allowed = _registry.requests()  # read now: a registered entry is accepted at once
    if request not in allowed:
        raise ValueError(f"precision must be one of {allowed}, got {request!r}")
    device_type = torch.device(device).type
    if request == _registry.AUTO:
        request = "bf16" if supports_bf16(device_type) else "fp16"
    elif _registry.REGISTRY[request].needs_bf16 and not supports_bf16(device_type):
        raise ValueError(
            f"precision={request!r} is not supported on device {device_type!r} "
            "(no bf16 autocast there); use precision='fp16' or 'auto'"
        )
    return PrecisionPolicy(request, device_type)


def device_of(params: Iterable[torch.Tensor]) -> torch.device:
    """The device of the first parameter (the model's device for policy purposes)."""
    for p in params:
        return p.device
    raise ValueError("model has no parameters: ampguard needs at least one trainable tensor")


def check_parameters(params: list[torch.Tensor], policy: PrecisionPolicy, *, argument: str) -> None:
    """Reject parameter lists that cannot train under ``policy``, naming ``argument``.

    Empty lists and non-floating parameters fail here, at construction, and so does whatever the
    precision's own rule refuses (fp16: fp16 parameters under the loss scaler, torch's
    "Attempting to unscale FP16 gradients").
    """
    if not params:
        raise ValueError(f"{argument} has no parameters to train")
    for p in params:
        if not p.is_floating_point():
            raise ValueError(
                f"{argument} holds a non-floating parameter of dtype {p.dtype}; "
                "only floating-point parameters can be trained"
            )
    refused = dtype_of(policy.entry.refused_params)
    if refused is not None and any(p.dtype == refused for p in params):
        raise ValueError(
            f"{argument} holds {policy.entry.refused_params} parameters (a model cast with "
            ".half()), but " + policy.entry.param_advice
        )
