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
    spike: bool = False  # the loss spiked (ampguard.replay.SpikeDetector), acted on or not
    spike_only: bool = False  # skipped for the loss spike alone (the gradients were finite)

    @property
    def applied(self) -> bool:
        return all(self.applied_per_optimizer)

    @property
    def overflow(self) -> bool:
        """fp16: the loss-scaled gradients overflowed, so (some) optimizers skipped."""
        return self.scaled and not self.spike_only and not all(self.applied_per_optimizer)

    @property
    def nonfinite(self) -> bool:
        """No loss scaler (bf16/fp32): non-finite gradients were found; skipped unless
        ``applied`` (a framework step that ampguard only watches)."""
        return self.observed or (
            not self.scaled and not self.spike_only and not all(self.applied_per_optimizer)
        )

    @property
    def skip_cause(self) -> str | None:
        """None when applied, else "collapse" | "loss_spike" | "overflow" | "nonfinite"."""
        if self.applied:
            return None
        if self.collapse:
            return "collapse"
        if self.spike_only:
            return "loss_spike"
        return "overflow" if self.scaled else "nonfinite"


def pack(
    found: list[torch.Tensor],
    dropped: torch.Tensor | None,
    loss_nonfinite: torch.Tensor | None = None,
    spike: tuple[torch.Tensor, bool] | None = None,
) -> torch.Tensor:
    """Pack a window's flags into one fp32 device scalar (exact integers below 2**24).

    Bit i = optimizer i overflowed; bit n = collapse (see :func:`add_collapse`); bit n + 1 =
    non-finite gradients observed on an applied step (see :func:`observed`); bit n + 2 = the
    window's loss was NaN/inf (``loss_nonfinite``, a 0-dim bool); bit n + 3 = the loss spiked
    (``spike``: a 0-dim 0/1 float and whether it skips the window), bit n + 4 = the spike skips
    the window; the bits above hold the dropped micro-batch count. Float arithmetic keeps it
    to one small op per flag.
    """
    n = len(found)
    status = found[0].clamp(max=1.0)
    for i in range(1, n):
        status = status.add(found[i].clamp(max=1.0), alpha=2**i)
    if loss_nonfinite is not None:
        status = status.add(loss_nonfinite, alpha=2 ** (n + 2))
    if spike is not None:
        flag, skips = spike
        status = status.add(flag, alpha=2 ** (n + 3) + (2 ** (n + 4) if skips else 0))
    if dropped is not None:
        status = status.add(dropped, alpha=2 ** (n + 5))
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
    found = tuple(bool((value >> i) & 1) for i in range(n))
    spike_skips = bool((value >> (n + 4)) & 1)
    applied = tuple(not (f or spike_skips) for f in found)
    return Decoded(
        applied,
        bool((value >> n) & 1),
        value >> (n + 5),
        scaled,
        bool((value >> (n + 1)) & 1),
        bool((value >> (n + 2)) & 1),
        bool((value >> (n + 3)) & 1),
        spike_skips and not any(found),
    )


class StepResult:
    """The outcome of :meth:`Guard.step`.

    ``applied``: every optimizer really stepped. ``loss_spike``: the window's loss spiked
    (``Guard(on_spike=...)``; skipped unless ``on_spike`` is ``"warn"``). ``overflow``: fp16: the
    loss-scaled gradients were non-finite, so (some) optimizers skipped. ``nonfinite``: bf16/fp32
    (no loss scaler): non-finite gradients were found, so (some) optimizers skipped
    (``Guard(skip_nonfinite=True)``, the default). ``skip_cause``: None when applied, else
    ``"overflow"``, ``"nonfinite"``, ``"loss_spike"`` or ``"collapse"``. ``grad_norm``: the unscaled
    total gradient norm before clipping (a tensor) when clipping, else None.
    ``dropped_microbatches``: non-finite micro-batches left out of the window (with
    ``contain_nonfinite_microbatches``). ``optimizers_applied``: per-optimizer detail. ``boundary``:
    this call ended an accumulation window.

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
        (fp16), "nonfinite" (bf16/fp32), "loss_spike" (``Guard(on_spike="skip" | "rewind" |
        "raise")``) or "collapse"."""
        return self._flags().skip_cause if self.boundary else None

    @property
    def loss_nonfinite(self) -> bool:
        """The window's loss was NaN/inf: a non-finite forward (the step was skipped because of
        it, not because the loss scale was too high)."""
        return self.boundary and self._flags().loss_nonfinite

    @property
    def loss_spike(self) -> bool:
        """The window's loss spiked (the Guard's flight recorder); the window was skipped for
        it unless ``on_spike="warn"`` or its gradients were non-finite as well."""
        return self.boundary and self._flags().spike

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
    skipped_spike: int = 0  # skipped for a loss spike alone (Guard(on_spike="skip"...))
    spikes: int = 0  # loss spikes detected, acted on or not
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
            if flags.spike_only:
                self.skipped_spike += 1
            elif flags.loss_nonfinite and flags.scaled:  # no loss scale fixes a NaN loss
                self.skipped_nonfinite_loss += 1  # (a collapse it caused included)
            elif flags.collapse:
                self.skipped_collapse += 1
            elif flags.nonfinite:
                self.skipped_nonfinite += 1
                self.consecutive_nonfinite += 1
            else:
                self.skipped_overflow += 1
        self.collapses += int(flags.collapse)
        self.spikes += int(flags.spike)
        self.dropped_microbatches += flags.dropped

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Counters:
        return cls(**{k: int(data.get(k, 0)) for k in asdict(cls())})
