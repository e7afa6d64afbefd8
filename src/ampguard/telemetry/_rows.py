"""The named records telemetry keeps on the hot path, between a step and the flush.

A step leaves one :class:`StepRow` (what the host knows of it, plus references to the tensors
the step made: its packed flags and its gradient norm); the window being sampled carries a
:class:`Sample` (which device-buffer slots hold its gradient statistics). Both are
``NamedTuple``: the flush transposes the rows into columns with one ``zip``; building a row
costs about half a microsecond more than the plain tuple it replaces (the step holds two fields
fewer, which gives part of it back). :class:`Resumed` is what :meth:`Telemetry.on_resume` answers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["NO_SAMPLE", "Resumed", "Sample", "StepRow"]


class Sample(NamedTuple):
    """Where the window in progress keeps its gradient statistics (-1: not sampled)."""

    stats_slot: int  # the slot of its per-tensor norms in the device buffer
    range_slot: int  # the slot of its exponent histogram
    grads_scaled: bool  # the sampled gradients were still multiplied by the loss scale


NO_SAMPLE = Sample(-1, -1, False)
"""The :class:`Sample` of a window whose gradients were not sampled."""


class StepRow(NamedTuple):
    """One recorded step, until the flush gathers its tensors and formats its log line.

    The precision and whether a loss scaler is in use are not per row: they change only at a
    fallback or a resume, each of which flushes first, so every row of a flush shares them."""

    step: int  # the window's 1-based step number
    micro: int  # micro-batches (losses) recorded in the window
    scale: float | None  # the scale after the step, read from host memory (None: on device)
    sample: Sample  # the window's gradient-statistics slots
    status: Any  # the packed step flags: a device tensor, an int, or None (all applied)
    grad_norm: Any  # the unscaled total gradient norm tensor the producer computed, or None


class Resumed(NamedTuple):
    """What :meth:`Telemetry.on_resume` hands back to the producer."""

    step: int  # the step count the run continues from (the producer adopts it)
    previous_scale: float | None  # the scale the log had at that step before the interruption
