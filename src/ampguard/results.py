"""What a step reports: :class:`StepResult`, its packed device flags, and running counters.

Per-window flags (which optimizer overflowed, collapse, micro-batches dropped) are packed into one
int64 device scalar so that reading them costs a single host sync, at the point where torch's own
GradScaler syncs, or lazily (fused optimizers) when the user first asks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["StepResult", "Decoded", "Counters", "pack", "add_collapse", "decode"]


class Decoded(NamedTuple):
    """Host view of one window's packed flags."""

    applied_per_optimizer: tuple[bool, ...]
    collapse: bool
    dropped: int

    @property
    def applied(self) -> bool:
        return all(self.applied_per_optimizer)

    @property
    def overflow(self) -> bool:
        return not all(self.applied_per_optimizer)


def pack(found: list[torch.Tensor], dropped: torch.Tensor | None) -> torch.Tensor:
    """Pack a window's flags into one fp32 device scalar (exact integers below 2**24).

    Bit i = optimizer i overflowed; bit n = collapse (see :func:`add_collapse`); the bits above
    hold the dropped micro-batch count. Float arithmetic keeps it to one small op per flag.
    """
    n = len(found)
    status = found[0].clamp(max=1.0)
    for i in range(1, n):
        status = status.add(found[i].clamp(max=1.0), alpha=2**i)
    if dropped is not None:
        status = status.add(dropped, alpha=2 ** (n + 1))
    return status


def add_collapse(status: torch.Tensor, collapse: torch.Tensor, n: int) -> torch.Tensor:
    """Set bit ``n`` where the 0-dim bool ``collapse`` is true."""
    return status.add(collapse, alpha=2**n)


def decode(value: float, n: int) -> Decoded:
    """Host view of :func:`pack` output read back as a number."""
    value = int(value)
    applied = tuple(not (value >> i) & 1 for i in range(n))
    return Decoded(applied, bool((value >> n) & 1), value >> (n + 1))


class StepResult:
    """The outcome of :meth:`Guard.step`.

    ``applied``: every optimizer really stepped. ``overflow``: non-finite gradients were found, so
    (some) optimizers skipped. ``grad_norm``: the unscaled total gradient norm (a tensor) when
    clipping, else None. ``dropped_microbatches``: non-finite micro-batches left out of the window
    (with ``contain_nonfinite_microbatches``). ``optimizers_applied``: per-optimizer detail.
    ``boundary``: this call ended an accumulation window.

    Cost: reading a flag of a fused-optimizer step syncs once (and settles all pending steps);
    otherwise the flags are already on the host.
    """

    __slots__ = ("step", "boundary", "grad_norm", "_decoded", "_owner")

    def __init__(self, step: int, boundary: bool, grad_norm: torch.Tensor | None,
                 decoded: Decoded | None, owner: Any = None) -> None:
        self.step = step
        self.boundary = boundary
        self.grad_norm = grad_norm
        self._decoded = decoded
        self._owner = owner

    @classmethod
    def in_window(cls, step: int, n_optimizers: int = 1) -> StepResult:
        return cls(step, False, None, Decoded((False,) * n_optimizers, False, 0))

    def _flags(self) -> Decoded:
        if self._decoded is None:
            self._owner._drain()  # fills self._decoded
        assert self._decoded is not None
        return self._decoded

    @property
    def applied(self) -> bool:
        return self.boundary and self._flags().applied

    @property
    def overflow(self) -> bool:
        return self.boundary and self._flags().overflow

    @property
    def dropped_microbatches(self) -> int:
        return self._flags().dropped if self.boundary else 0

    @property
    def optimizers_applied(self) -> tuple[bool, ...]:
        return self._flags().applied_per_optimizer

    def __repr__(self) -> str:
        if self._decoded is None:
            return f"StepResult(step={self.step}, flags pending on device)"
        return (f"StepResult(step={self.step}, boundary={self.boundary}, applied={self.applied}, "
                f"overflow={self.overflow}, dropped_microbatches={self.dropped_microbatches})")


@dataclass
class Counters:
    """Running host-side totals over completed windows."""

    applied: int = 0
    skipped: int = 0
    skipped_overflow: int = 0
    skipped_collapse: int = 0
    collapses: int = 0
    dropped_microbatches: int = 0
    consecutive_skips: int = 0

    def record(self, flags: Decoded) -> None:
        if flags.applied:
            self.applied += 1
            self.consecutive_skips = 0
        else:
            self.skipped += 1
            self.consecutive_skips += 1
            if flags.collapse:
                self.skipped_collapse += 1
            else:
                self.skipped_overflow += 1
        self.collapses += int(flags.collapse)
        self.dropped_microbatches += flags.dropped

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Counters:
        return cls(**{k: int(data.get(k, 0)) for k in asdict(cls())})
