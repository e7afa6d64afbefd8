"""A short on-device history of the loss scale after each window, for messages and summaries.

Recording is two small device ops per window (no host sync); reading syncs once.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ScaleHistory"]


class ScaleHistory:
    """Ring buffer of the last ``size`` scales (one per window) plus a count of scale changes."""

    def __init__(self, initial: float, device: torch.device, size: int = 32) -> None:
        self.size = size
        self._values = torch.full((size,), initial, dtype=torch.float32, device=device)
        self._changes = torch.zeros((), dtype=torch.int64, device=device)

    def record(self, step: int, scale: torch.Tensor) -> None:
        """Store the scale after window ``step`` (1-based). Cost: no host sync."""
        self._changes.add_(self._values[(step - 1) % self.size] != scale)
        self._values[step % self.size].copy_(scale)

    def reset(self, value: float) -> None:
        """Forget the history; every slot holds ``value`` (after a resume)."""
        self._values.fill_(value)

    def state_dict(self) -> dict[str, Any]:
        """The kept scales and the change count as plain numbers. Cost: one host sync."""
        values = torch.cat([self._values.double(), self._changes.double().reshape(1)]).tolist()
        return {"values": values[:-1], "changes": int(values[-1])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (same ring size). Cost: no host sync."""
        values = [float(v) for v in state["values"]]
        if len(values) != self.size:
            raise ValueError(f"scale history holds {len(values)} values, expected {self.size}")
        self._values.copy_(torch.tensor(values, dtype=torch.float32))
        self._changes.fill_(int(state["changes"]))

    def used_at(self, step: int) -> float:
        """The scale window ``step`` ran with (the one after ``step - 1``). Cost: one sync."""
        return float(self._values[(step - 1) % self.size])

    def tail(self, step: int, k: int | None = None) -> list[tuple[int, float]]:
        """``(step, scale)`` for the last ``k`` (default all kept) windows up to ``step``.

        Cost: one host sync.
        """
        k = self.size if k is None else min(k, self.size)
        values = self._values.tolist()
        return [(s, values[s % self.size]) for s in range(max(1, step - k + 1), step + 1)]

    def changes(self) -> int:
        """How many windows changed the scale. Cost: one host sync."""
        return int(self._changes.item())
