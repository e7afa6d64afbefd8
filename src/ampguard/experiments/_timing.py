"""Step timing for :func:`ampguard.compare`: robust per-step seconds of a training loop."""

from __future__ import annotations

import math
import statistics
import time

import torch

__all__ = ["StepClock"]


class StepClock:
    """Step times after the first (which pays one-off costs: warm-up, optimizer state).

    On CPU each step's wall time is exact, and the median ignores the preemption spikes of a
    busy machine; on an accelerator steps run asynchronously, so the mean over one timed
    window (synchronised at both ends) is used.

    Cost: on an accelerator, one device sync after step 1 and one in :meth:`stop`; none on CPU.
    """

    def __init__(self, device_type: str) -> None:
        self._device = device_type
        self._last = time.perf_counter()
        self._times: list[float] = []
        self._start: float | None = None

    def _sync(self) -> None:
        if self._device == "cuda":
            torch.cuda.synchronize()
        elif self._device != "cpu" and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize()

    def tick(self) -> None:
        if self._start is None:  # end of step 1: start timing
            self._sync()
            self._start = self._last = time.perf_counter()
            return
        now = time.perf_counter()
        self._times.append(now - self._last)
        self._last = now

    def stop(self) -> tuple[float, int, float]:
        """(seconds of the timed steps, their count, seconds per step)."""
        self._sync()
        if self._start is None or not self._times:
            return 0.0, 0, math.nan
        total = time.perf_counter() - self._start
        per_step = (
            total / len(self._times) if self._device != "cpu" else statistics.median(self._times)
        )
        return total, len(self._times), per_step
