"""The global RNG states a replay starts from: capture and restore.

Cost: host copies of the generator states (the CPU generator's and, for an accelerator, every
device's); no device sync.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state(device_type: str) -> dict[str, Any]:
    """The global RNG state a replay can start from: ``{"cpu": ...}`` plus the accelerator's
    (``"cuda": [...]``, every device) where ``device_type`` has one. Cost: host copies of the
    generator states, no device sync."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    mod = getattr(torch, device_type, None) if device_type != "cpu" else None
    if mod is not None and hasattr(mod, "get_rng_state_all"):
        state[device_type] = mod.get_rng_state_all()
    return state


def set_rng_state(device_type: str, state: dict[str, Any]) -> None:
    """Put back a state of :func:`rng_state`. Cost: no device sync."""
    torch.set_rng_state(state["cpu"])
    if device_type != "cpu" and device_type in state:
        getattr(torch, device_type).set_rng_state_all(state[device_type])
