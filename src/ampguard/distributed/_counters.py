"""Per-rank overflow counters of a distributed Guard (the overflow origin), kept on the device.

Two sources feed them. With the found_inf consensus, each window's all-reduced ``(world, n + 1)``
rows hold every rank's own flags and dropped micro-batches. Without it (plain DDP), each rank
knows only whether its OWN loss was finite; the audit gathers those counts from every rank
(:meth:`RankCounters.columns` / :meth:`RankCounters.adopt`). Windows are kept as device tensors
and folded into the counters every :data:`FOLD_EVERY` windows: no host sync.
"""

from __future__ import annotations

import torch

__all__ = ["FOLD_EVERY", "RankCounters"]

FOLD_EVERY = 64  # windows between folds of the per-window flags into the counters
_NEVER = torch.iinfo(torch.int64).max


class RankCounters:
    """``overflows`` (windows in which each rank's own gradients, or without consensus its own
    loss, were non-finite), ``dropped`` (micro-batches each rank dropped), ``first_overflow``
    (the first such window per rank; int64 max for never). Device int64 tensors of ``world``."""

    def __init__(self, world: int, rank: int, device: torch.device) -> None:
        self.rank = rank
        self._overflows = torch.zeros(world, dtype=torch.int64, device=device)
        self._dropped = torch.zeros(world, dtype=torch.int64, device=device)
        self._first = torch.full((world,), _NEVER, dtype=torch.int64, device=device)
        self._rows: list[torch.Tensor] = []  # consensus windows not yet folded
        self._row_steps: list[int] = []
        self._finite: list[torch.Tensor] = []  # this window's loss checks (no consensus)
        self._local: list[torch.Tensor] = []  # per window: own loss finite (no consensus)
        self._local_steps: list[int] = []

    # ------------------------------------------------------------------ feeding
    def add_rows(self, rows: torch.Tensor, step: int) -> None:
        """One window's all-reduced consensus rows. Cost: no host sync."""
        self._rows.append(rows)
        self._row_steps.append(step)
        if len(self._rows) >= FOLD_EVERY:
            self.fold()

    def note_loss(self, loss: torch.Tensor) -> None:
        """This rank's loss of one micro-batch. Cost: one tiny device op; no host sync."""
        self._finite.append(torch.isfinite(loss.detach()).reshape(()))

    def end_window(self, step: int) -> None:
        """Close the window of the losses noted since the last call. Cost: no host sync."""
        if not self._finite:
            return
        checks, self._finite = self._finite, []
        self._local.append(checks[0] if len(checks) == 1 else torch.stack(checks).all())
        self._local_steps.append(step)
        if len(self._local) >= FOLD_EVERY:
            self.fold()

    # ------------------------------------------------------------------ counters
    def fold(self) -> None:
        """Add the windows seen since the last fold to the counters (device ops)."""
        if self._local:  # no consensus: this rank's own column only
            over = torch.zeros(
                len(self._local),
                self._overflows.numel(),
                dtype=torch.bool,
                device=self._overflows.device,
            )
            over[:, self.rank] = ~torch.stack(self._local).to(over.device)
            self._add(over, self._local_steps)
            self._local.clear()
            self._local_steps.clear()
        if self._rows:
            rows = torch.stack(self._rows)  # (windows, world, n + 1)
            self._add(rows[..., :-1].amax(dim=-1) > 0, self._row_steps)  # (windows, world)
            self._dropped.add_(rows[..., -1].sum(dim=0).long())
            self._rows.clear()
            self._row_steps.clear()

    def _add(self, over: torch.Tensor, window_steps: list[int]) -> None:
        steps = torch.tensor(window_steps, dtype=torch.int64, device=over.device)
        self._overflows.add_(over.sum(dim=0))
        first = torch.where(over, steps[:, None], _NEVER).amin(dim=0)
        torch.minimum(self._first, first, out=self._first)

    @property
    def overflows(self) -> torch.Tensor:
        self.fold()
        return self._overflows

    @property
    def dropped(self) -> torch.Tensor:
        self.fold()
        return self._dropped

    @property
    def first_overflow(self) -> torch.Tensor:
        self.fold()
        return self._first

    # ------------------------------------------------------------------ audit
    def columns(self) -> torch.Tensor:
        """This rank's own (overflows, first overflow, dropped), for the audit to gather."""
        self.fold()
        r = self.rank
        return torch.stack([self._overflows[r], self._first[r], self._dropped[r]])

    def adopt(self, table: torch.Tensor) -> None:
        """Every rank's counters from an audit's gathered ``(world, 3)`` table."""
        self._overflows.copy_(table[:, 0])
        self._first.copy_(table[:, 1])
        self._dropped.copy_(table[:, 2])
