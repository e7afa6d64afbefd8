"""Shared benchmark helpers: interleaved timing rounds and a host-sync counter."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "interleaved_medians", "count_syncs"]


class _ScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: every ``.item()``/``bool(t)``/``int(t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _ListReads(TorchFunctionMode):
    """Counts ``Tensor.tolist``, which syncs without reaching the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.count += 1
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Context manager counting host syncs: scalar reads plus ``tolist`` calls."""

    def __enter__(self) -> SyncCounter:
        self._lists, self._scalars = _ListReads(), _ScalarReads()
        self._lists.__enter__()
        self._scalars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._scalars.__exit__(*exc)
        self._lists.__exit__(*exc)

    @property
    def count(self) -> int:
        return self._scalars.count + self._lists.count


def count_syncs(step: Callable[[], None], steps: int) -> float:
    """Host syncs per call of ``step`` over ``steps`` calls."""
    with SyncCounter() as counter:
        for _ in range(steps):
            step()
    return counter.count / steps


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
