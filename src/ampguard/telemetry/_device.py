"""Telemetry's device record buffer: one flat fp32 tensor, copied to the host in one transfer.

Layout (``F`` = ``flush_every``, ``P`` = parameter tensors, ``L`` = layers)::

    [ scale | norm | status | loss ]   FIXED columns of F values, one per recorded step
    [ S x P per-tensor grad norms  ]   one row per gradient sample (S slots)
    [ R x L*(1+BINS) range stats   ]   one row per range sample (R slots)

On the CPU a plain step writes nothing here (the scale is read from host memory); on a device
it copies the scaler's live scale into its cell. The step's flags (unless the producer read
them), loss and norm are tensors the step made anyway, kept by reference, and so are the
per-tensor gradient norms of a sample: the flush stacks them into their places, one op for each
run of adjacent places (losses and samples are adjacent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ampguard.rules import RANGE_BINS
from ampguard.telemetry._records import FIXED, LOSS, NORM, SCALE, STATUS, Values

__all__ = ["DeviceBuffer", "host_view", "stack_values"]

_HOLD = 1 << 14  # per-tensor norms kept as tensors before they are written into the buffer


class DeviceBuffer:
    """The preallocated record buffer of one Telemetry (see the module docstring)."""

    def __init__(
        self,
        flush_every: int,
        tensors: int,
        layers: int,
        stats_every: int,
        range_every: int,
        device: torch.device,
    ) -> None:
        f = flush_every
        # slots: at most one sample per window; the window in progress may hold one more
        self.stats_slots = math.ceil(f / stats_every) + 1
        self.range_slots = math.ceil(f / range_every) + 1 if range_every else 0
        self.range_width = layers * (1 + RANGE_BINS)
        self._stats_at = FIXED * f
        self._ranges_at = self._stats_at + self.stats_slots * tensors
        total = self._ranges_at + self.range_slots * self.range_width
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.fixed = self.flat[: self._stats_at].view(FIXED, f)
        self.scale_cells = list(self.fixed[SCALE])  # 0-dim views: a per-step copy needs no index
        self.stats = list(
            self.flat[self._stats_at : self._ranges_at].view(self.stats_slots, tensors).unbind()
        )
        # per range slot: its row, and the row's per-layer amax and histogram views
        self.ranges = [
            (row, row[:layers], row[layers:])
            for row in self.flat[self._ranges_at :].view(self.range_slots, self.range_width)
        ]
        self._tensors = tensors
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._step_of: dict[tuple[int, ...], torch.Tensor] = {}
        self._held: dict[int, Sequence[torch.Tensor]] = {}  # stats slot -> its per-tensor norms

    def hold_norms(self, slot: int, norms: Sequence[torch.Tensor]) -> None:
        """Keep the per-tensor norms of stats sample ``slot`` (0-dim tensors, as
        ``torch._foreach_norm`` returns them) until :meth:`write_norms`, which stacks every
        kept sample in one op; written at once when more than ``_HOLD`` norms are kept."""
        self._held[slot] = norms
        if len(self._held) * self._tensors > _HOLD:
            self.write_norms()

    def drop_norms(self, slot: int) -> None:
        """Forget the kept norms of ``slot`` (its window ended without a step)."""
        self._held.pop(slot, None)

    def write_norms(self) -> None:
        """Write the kept norms into their slots (one stack when the slots are consecutive)."""
        self._write(self._take_held())

    def _take_held(self) -> list[tuple[int, Sequence[torch.Tensor]]]:
        held, self._held = self._held, {}
        return [(self._stats_at + slot * self._tensors, held[slot]) for slot in sorted(held)]

    def _write(self, segments: list[tuple[int, Sequence[torch.Tensor]]]) -> None:
        """Write each ``(offset, single-element tensors)`` segment at its offset in the flat
        buffer; segments that meet are stacked together (one op for the whole flush when the
        buffer is full)."""
        merged: list[tuple[int, list[torch.Tensor]]] = []
        for offset, tensors in sorted(segments, key=lambda seg: seg[0]):
            if merged and merged[-1][0] + len(merged[-1][1]) == offset:
                merged[-1][1].extend(tensors)
            else:
                merged.append((offset, list(tensors)))
        for offset, tensors in merged:
            _stack_into(self.flat[offset : offset + len(tensors)], tensors)

    def used(self, stats: int, ranges: int) -> torch.Tensor:
        """The prefix of the buffer that holds the fixed columns and the first ``stats`` and
        ``ranges`` samples (what a flush copies)."""
        if ranges:
            return self.flat[: self._ranges_at + ranges * self.range_width]
        return self.flat[: self._stats_at + stats * self._tensors]

    def gather(
        self,
        statuses: Sequence[torch.Tensor | int | None],
        norms: Sequence[torch.Tensor | None],
        losses: list[torch.Tensor],
        micro: Sequence[int],
    ) -> None:
        """Write the flush's per-step tensors into their columns: the packed flags given as
        tensors, the producer's grad norm (None: 0), each step's loss summed over its ``micro``
        micro-batches (``losses`` in step order), and the kept gradient norms. Cost: a stack per
        run of adjacent columns (flags, losses and the samples are adjacent), no host sync."""
        n, f, zero = len(statuses), self.fixed.shape[1], self._zero
        segments = self._take_held()
        if any(isinstance(s, torch.Tensor) for s in statuses):
            segments.append(
                (STATUS * f, [s if isinstance(s, torch.Tensor) else zero for s in statuses])
            )
        if any(g is not None for g in norms):
            segments.append((NORM * f, [zero if g is None else g for g in norms]))
        accumulated = losses and (len(losses) != n or min(micro) != 1)
        if losses and not accumulated:  # one loss per step
            segments.append((LOSS * f, losses))
        self._write(segments)
        if accumulated:
            values = stack_values(losses).float()
            self.fixed[LOSS, :n].zero_().index_add_(0, self._steps_of(tuple(micro)), values)

    def _steps_of(self, micro: tuple[int, ...]) -> torch.Tensor:
        """The step of each loss (step i has ``micro[i]`` of them), on the device. Windows
        repeat one shape, so it is made once (on CUDA through pinned memory: no sync)."""
        index = self._step_of.get(micro)
        if index is None:
            index = torch.repeat_interleave(
                torch.arange(len(micro)), torch.tensor(micro, dtype=torch.int64)
            )
            if self.flat.device.type == "cuda":
                index = index.pin_memory().to(self.flat.device, non_blocking=True)
            if len(self._step_of) >= 8:
                self._step_of.clear()
            self._step_of[micro] = index
        return index

    def carry(self, stats_slot: int, range_slot: int) -> tuple[int, int]:
        """Move the samples of the window in progress (slots, -1: none) to slot 0, so that they
        survive a flush; returns their new slots."""
        if stats_slot >= 0:
            self.write_norms()
            if stats_slot:
                self.stats[0].copy_(self.stats[stats_slot])
            stats_slot = 0
        if range_slot >= 0:
            if range_slot:
                self.ranges[0][0].copy_(self.ranges[range_slot][0])
            range_slot = 0
        return stats_slot, range_slot

    def host_values(self, host: np.ndarray, stats: int, ranges: int) -> Values:
        """The host copy of :meth:`used` as :class:`Values`."""
        f = self.fixed.shape[1]
        fixed = host[: self._stats_at].reshape(FIXED, f)
        norms = host[self._stats_at : self._stats_at + stats * self._tensors]
        at = self._ranges_at
        return Values(
            fixed,
            norms.reshape(stats, self._tensors),
            host[at : at + ranges * self.range_width].reshape(ranges, self.range_width),
        )


def host_view(t: torch.Tensor) -> memoryview[float] | None:
    """The value of the one-element fp32 CPU tensor ``t``, readable as ``view[0]`` straight from
    host memory (no torch op, no sync; it follows in-place updates of ``t``), or None where
    ``t`` lives on a device or is not a single fp32 value."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.numel() != 1:
        return None
    host: Any = t.detach().numpy()  # shares the tensor's memory
    return memoryview(host).cast("B").cast("f")


def _stack_into(out: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Write the single-element ``tensors`` into the 1-D ``out``: one op when they are fp32 of
    one shape (the usual case), else through :func:`stack_values`."""
    try:
        torch.stack(tensors, out=out.view(len(tensors), *tensors[0].shape))
    except (RuntimeError, TypeError):  # mixed shapes or dtypes
        out.copy_(stack_values(tensors))


def stack_values(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The single-element ``tensors`` as one 1-D tensor (one op when they share a shape)."""
    shape = tensors[0].shape
    if all(t.shape == shape for t in tensors):
        return torch.stack(list(tensors)).reshape(-1)
    return torch.stack([t.reshape(()) for t in tensors])
