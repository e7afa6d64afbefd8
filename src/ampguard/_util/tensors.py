"""Small facts about modules and optimizers, read without importing torch (duck-typed), so that
``_util`` stays torch-free (tests/test_architecture.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["params_of", "is_fused", "device_type"]


def params_of(opt: Any) -> list[Any]:
    """Every parameter of a ``torch.optim.Optimizer``, over all its param_groups, in order."""
    return [p for g in opt.param_groups for p in g["params"]]


def is_fused(opt: Any) -> bool:
    """The optimizer unscales inside its own step (fused Adam/AdamW/SGD)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def device_type(model: Any) -> str:
    """``"cuda"``, ``"cpu"``, ...: the device type of a module's first parameter; ``"cpu"`` for a
    module without parameters."""
    for p in model.parameters():
        return str(p.device.type)
    return "cpu"
