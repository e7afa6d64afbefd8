"""Precision policy: resolve a precision request against a device.

``"auto"`` picks bf16 where the device supports bf16 autocast, else fp16. Only fp16 gets a loss
scaler (under bf16 a scaler is wasted work, under fp32 meaningless). ``"fp32"`` means autocast off.
``"fp8"`` is bf16 autocast plus torchao float8 training of the Linear layers (the Guard converts
them; see :mod:`ampguard.fp8._guard`): no loss scaler, fp8 scales every tensor by its own amax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = [
    "PRECISIONS",
    "PrecisionPolicy",
    "resolve_precision",
    "supports_bf16",
    "device_of",
    "check_parameters",
]

PRECISIONS = ("auto", "fp16", "bf16", "fp32", "fp8")
_DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": None,
    "fp8": torch.bfloat16,
}  # fp8: bf16 autocast around the fp8 Linear layers


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

    precision: str  # "fp16" | "bf16" | "fp32" | "fp8"
    device_type: str

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype, or ``None`` for fp32 (autocast off)."""
        return _DTYPES[self.precision]

    @property
    def needs_scaler(self) -> bool:
        """True only for fp16: the one precision whose gradients underflow without scaling."""
        return self.precision == "fp16"

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """An autocast context for this policy; a no-op context under fp32."""
        if self.dtype is None or not enabled:
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(self.device_type, dtype=self.dtype)


def resolve_precision(request: str, device: torch.device | str) -> PrecisionPolicy:
    """Resolve ``request`` ("auto"|"fp16"|"bf16"|"fp32"|"fp8") for ``device``.

    Raises ``ValueError`` naming ``precision`` for an unknown request or bf16 on a device
    without bf16 autocast.
    """
    if request not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {request!r}")
    device_type = torch.device(device).type
    if request == "auto":
        request = "bf16" if supports_bf16(device_type) else "fp16"
    elif request in ("bf16", "fp8") and not supports_bf16(device_type):
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

    Empty lists, non-floating parameters and fp16 parameters combined with the fp16 scaler
    (torch's "Attempting to unscale FP16 gradients") fail here, at construction.
    """
    if not params:
        raise ValueError(f"{argument} has no parameters to train")
    for p in params:
        if not p.is_floating_point():
            raise ValueError(
                f"{argument} holds a non-floating parameter of dtype {p.dtype}; "
                "only floating-point parameters can be trained"
            )
    if policy.needs_scaler and any(p.dtype == torch.float16 for p in params):
        raise ValueError(
            f"{argument} holds float16 parameters (a model cast with .half()), but "
            "precision='fp16' uses a loss scaler, which needs fp32 master weights: fp16 "
            "updates underflow and torch refuses to unscale fp16 gradients. Keep the model in "
            "float32 and let autocast run the fp16 math (remove .half()), or use precision='bf16'."
        )
