"""Optimizer helpers for attach mode: unwrap framework wrappers, detect fused (in-kernel) steps.

Frameworks hand the scaler the *inner* optimizer (Accelerate's ``AcceleratedOptimizer.optimizer``,
Lightning's ``LightningOptimizer._optimizer``), and ``torch.amp.GradScaler`` keys its per-optimizer
state by ``id`` of what it was given, so attach mode always works with the innermost optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["unwrap_optimizer", "as_optimizer_list", "is_fused", "params_of"]

_WRAPPER_ATTRS = ("optimizer", "_optimizer")


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The innermost ``torch.optim.Optimizer`` inside framework wrappers around ``opt``."""
    seen = {id(opt)}
    while True:
        inner = None
        for attr in _WRAPPER_ATTRS:
            candidate = opt.__dict__.get(attr) if hasattr(opt, "__dict__") else None
            if isinstance(candidate, torch.optim.Optimizer) and id(candidate) not in seen:
                inner = candidate
                break
        if inner is None:
            break
        seen.add(id(inner))
        opt = inner
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (or a framework wrapper around one) or a "
            f"list of them, got {type(opt).__name__}"
        )
    return opt


def as_optimizer_list(optimizer: Any) -> list[torch.optim.Optimizer]:
    """One optimizer or a list/tuple of them, unwrapped; rejects empty lists and duplicates."""
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not items:
        raise ValueError("optimizer must be an optimizer or a non-empty list of optimizers")
    opts = [unwrap_optimizer(o) for o in items]
    if len({id(o) for o in opts}) != len(opts):
        raise ValueError("optimizer lists the same optimizer twice")
    return opts


def is_fused(opt: torch.optim.Optimizer) -> bool:
    """True when the optimizer unscales and skips inside its own kernel (``fused=True`` Adam/AdamW,
    SGD): ``GradScaler.step`` then calls ``optimizer.step`` even on a skipped step."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def params_of(opts: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """All parameters of ``opts`` in order, each once."""
    seen: set[int] = set()
    out = []
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out
