"""What a step reports: :class:`StepResult`, its packed device flags, and running counters.

Per-window flags (which optimizer overflowed, collapse, micro-batches dropped) are packed into one
int64 device scalar so that reading them costs a single host sync, at the point where torch's own
GradScaler syncs, or lazily (fused optimizers) when the user first asks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "StepResult",
    "Decoded",
    "Counters",
    "pack",
    "observed",
    "add_collapse",
    "decode",
    "loss_nonfinite",
]


class Decoded(NamedTuple):
    """Host view of one window's packed flags."""

    applied_per_optimizer: tuple[bool, ...]
    collapse: bool
    dropped: int
    scaled: bool = True  # a loss scaler was in use: a skip is an overflow, else non-finite
    observed: bool = False  # non-finite gradients seen on a step ampguard does not own (watch)
    loss_nonfinite: bool = False  # the window's loss was NaN/inf (a non-finite forward)

    @property
    def applied(self) -> bool:
        return all(self.applied_per_optimizer)

    @property
    def overflow(self) -> bool:
        """fp16: the loss-scaled gradients overflowed, so (some) optimizers skipped."""
        return self.scaled and not all(self.applied_per_optimizer)

    @property
    def nonfinite(self) -> bool:
        """No loss scaler (bf16/fp32): non-finite gradients were found; skipped unless
        ``applied`` (a framework step that ampguard only watches)."""
        return self.observed or (not self.scaled and not all(self.applied_per_optimizer))

    @property
    def skip_cause(self) -> str | None:
        """None when applied, else "collapse" | "overflow" | "nonfinite"."""
        if self.applied:
            return None
        if self.collapse:
            return "collapse"
        return "overflow" if self.scaled else "nonfinite"


def pack(
    found: list[torch.Tensor],
    dropped: torch.Tensor | None,
    loss_nonfinite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack a window's flags into one fp32 device scalar (exact integers below 2**24).

    Bit i = optimizer i overflowed; bit n = collapse (see :func:`add_collapse`); bit n + 1 =
    non-finite gradients observed on an applied step (see :func:`observed`); bit n + 2 = the
    window's loss was NaN/inf (``loss_nonfinite``, a 0-dim bool); the bits above hold the
    dropped micro-batch count. Float arithmetic keeps it to one small op per flag.
    """
    n = len(found)
    status = found[0].clamp(max=1.0)
    for i in range(1, n):
        status = status.add(found[i].clamp(max=1.0), alpha=2**i)
    if loss_nonfinite is not None:
        status = status.add(loss_nonfinite, alpha=2 ** (n + 2))
    if dropped is not None:
        status = status.add(dropped, alpha=2 ** (n + 3))
    return status


def loss_nonfinite(losses: list[torch.Tensor]) -> torch.Tensor | None:
    """0-dim bool on the device: some micro-batch loss of the window was NaN/inf (None for no
    losses). Cost: no host sync; one or two small device ops per window."""
    if not losses:
        return None
    if len(losses) == 1:
        return torch.isfinite(losses[0]).logical_not()
    return torch.isfinite(torch.stack(losses)).all().logical_not()


def observed(found: torch.Tensor, n: int) -> torch.Tensor:
    """Flags of a step that was applied although ``found`` (0-dim, nonzero: non-finite
    gradients) says its gradients were not finite: bit ``n + 1`` (a watched loop without a
    scaler, whose step ampguard does not own). Cost: no host sync."""
    return found.clamp(max=1.0).mul(2 ** (n + 1))


def add_collapse(status: torch.Tensor, collapse: torch.Tensor, n: int) -> torch.Tensor:
    """Set bit ``n`` where the 0-dim bool ``collapse`` is true."""
    return status.add(collapse, alpha=2**n)


def decode(value: float, n: int, scaled: bool = True) -> Decoded:
    """Host view of :func:`pack` output read back as a number (``scaled``: a loss scaler was in
    use for the window, so a skip is an fp16 overflow rather than a non-finite skip)."""
    value = int(value)
    applied = tuple(not (value >> i) & 1 for i in range(n))
    return Decoded(
        applied,
        bool((value >> n) & 1),
        value >> (n + 3),
        scaled,
        bool((value >> (n + 1)) & 1),
        bool((value >> (n + 2)) & 1),
    )


class StepResult:
    """The outcome of :meth:`Guard.step`.

    ``applied``: every optimizer really stepped. ``overflow``: fp16: the loss-scaled gradients
    were non-finite, so (some) optimizers skipped. ``nonfinite``: bf16/fp32 (no loss scaler):
    non-finite gradients were found, so (some) optimizers skipped (``Guard(skip_nonfinite=True)``,
    the default). ``skip_cause``: None when applied, else ``"overflow"``, ``"nonfinite"`` or
    ``"collapse"``. ``grad_norm``: the unscaled total gradient norm before clipping (a tensor)
    when clipping, else None. ``dropped_microbatches``: non-finite micro-batches left out of the
    window (with ``contain_nonfinite_microbatches``). ``optimizers_applied``: per-optimizer detail.
    ``boundary``: this call ended an accumulation window.

    Cost: reading a flag of a fused-optimizer step syncs once (and settles all pending steps);
    otherwise the flags are already on the host.
    """

    __slots__ = ("step", "boundary", "grad_norm", "_decoded", "_owner")

    def __init__(
        self,
        step: int,
        boundary: bool,
        grad_norm: torch.Tensor | None,
        decoded: Decoded | None,
        owner: Any = None,
    ) -> None:
        self.step = step
        self.boundary = boundary
        self.grad_norm = grad_norm
        self._decoded = decoded
        self._owner = owner

    @classmethod
    def in_window(cls, step: int, n_optimizers: int = 1) -> StepResult:
        return cls(step, False, None, Decoded((False,) * n_optimizers, False, 0))

    def settle(self, decoded: Decoded) -> Decoded:
        """Fill in the flags of a pending window (its owner, the Guard, calls this once it has
        read them from the device); returns ``decoded``. Cost: no host sync."""
        self._decoded = decoded
        return decoded

    def _flags(self) -> Decoded:
        if self._decoded is None:
            self._owner.settle_pending()  # the owning Guard: calls settle() on this result
        assert self._decoded is not None
        return self._decoded

    @property
    def applied(self) -> bool:
        return self.boundary and self._flags().applied

    @property
    def overflow(self) -> bool:
        return self.boundary and self._flags().overflow

    @property
    def nonfinite(self) -> bool:
        return self.boundary and self._flags().nonfinite

    @property
    def skip_cause(self) -> str | None:
        """Why the window did not update: None (applied, or not a window's end), "overflow"
        (fp16), "nonfinite" (bf16/fp32) or "collapse"."""
        return self._flags().skip_cause if self.boundary else None

    @property
    def loss_nonfinite(self) -> bool:
        """The window's loss was NaN/inf: a non-finite forward (the step was skipped because of
        it, not because the loss scale was too high)."""
        return self.boundary and self._flags().loss_nonfinite

    @property
    def dropped_microbatches(self) -> int:
        return self._flags().dropped if self.boundary else 0

    @property
    def optimizers_applied(self) -> tuple[bool, ...]:
        return self._flags().applied_per_optimizer

    def __repr__(self) -> str:
        if self._decoded is None:
            return f"StepResult(step={self.step}, flags pending on device)"
        return (
            f"StepResult(step={self.step}, boundary={self.boundary}, applied={self.applied}, "
            f"overflow={self.overflow}, nonfinite={self.nonfinite}, "
            f"dropped_microbatches={self.dropped_microbatches})"
        )


@dataclass
class Counters:
    """Running host-side totals over completed windows."""

    applied: int = 0
    skipped: int = 0
    skipped_overflow: int = 0
    skipped_collapse: int = 0
    skipped_nonfinite: int = 0
    # fp16 skips whose loss was NaN/inf: a non-finite forward, not an overflow (without a
    # scaler such a skip stays in skipped_nonfinite, AG109's count)
    skipped_nonfinite_loss: int = 0
    collapses: int = 0
    dropped_microbatches: int = 0
    consecutive_skips: int = 0
    consecutive_nonfinite: int = 0  # non-finite skips in a row without a scaler (the bound)

    def record(self, flags: Decoded) -> None:
        if flags.applied:
            self.applied += 1
            self.consecutive_skips = self.consecutive_nonfinite = 0
        else:
            self.skipped += 1
            self.consecutive_skips += 1
            if flags.loss_nonfinite and flags.scaled:  # no loss scale fixes a NaN loss
                self.skipped_nonfinite_loss += 1  # (a collapse it caused included)
            elif flags.collapse:
                self.skipped_collapse += 1
            elif flags.nonfinite:
                self.skipped_nonfinite += 1
                self.consecutive_nonfinite += 1
            else:
                self.skipped_overflow += 1
        self.collapses += int(flags.collapse)
        self.dropped_microbatches += flags.dropped

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Counters:
        return cls(**{k: int(data.get(k, 0)) for k in asdict(cls())})
