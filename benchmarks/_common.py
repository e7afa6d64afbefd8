"""Shared benchmark helpers: interleaved timing rounds, and ampguard.testing's host-sync counter."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from ampguard.testing import SyncCounter, count_syncs

__all__ = ["SyncCounter", "interleaved_medians", "count_syncs"]


def interleaved_medians(loops: dict[str, Callable[[], None]], rounds: int,
                        steps_per_round: int) -> dict[str, float]:
    """Median seconds per step of each loop, timing them round-robin to cancel machine noise."""
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, step in loops.items():
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            times[name].append((time.perf_counter() - t0) / steps_per_round)
    return {name: statistics.median(ts) for name, ts in times.items()}
