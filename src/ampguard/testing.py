"""Test helpers: count the host syncs a piece of PyTorch code makes.

>>> t = torch.ones(3)
>>> with SyncCounter() as syncs:
...     total = t.sum().item()
>>> syncs.count
1

Works on any device, CPU included, so a test can assert "this step adds no host sync" without a
GPU. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the stricter check: it also catches
syncs that read no value into Python (``torch.cuda.synchronize``, a blocking copy, a data-dependent
shape such as ``nonzero``), which this counter does not see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "count_syncs"]


class _ScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: every ``.item()``, ``bool(t)``, ``int(t)``, ..."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _ListReads(TorchFunctionMode):
    """Counts ``Tensor.tolist``, which reads device values without reaching the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.tolist:
            self.count += 1
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Context manager counting the device-to-host reads made inside it.

    Counts two things: scalar reads (every call of ``aten._local_scalar_dense``: ``.item()``,
    ``bool(t)``, ``int(t)``, ``float(t)``, ``if t:``) and ``Tensor.tolist()`` calls (one each,
    however long the list). ``count`` is their sum, readable inside the block and after it;
    each ``with`` starts again from 0.
    Pure device ops (``add``, ``matmul``, an optimizer's foreach/fused kernels) count 0. On
    CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the stricter check: it also sees syncs
    that read no value into Python (``torch.cuda.synchronize``, blocking copies, ``nonzero``).

    Cost: none of its own; every op inside the block passes through two Python-level modes, so
    do not time code while counting it.
    """

    def __init__(self) -> None:
        self._scalars = _ScalarReads()
        self._lists = _ListReads()

    def __enter__(self) -> SyncCounter:
        self._scalars, self._lists = _ScalarReads(), _ListReads()
        self._lists.__enter__()
        self._scalars.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scalars.__exit__(*exc)
        self._lists.__exit__(*exc)

    @property
    def count(self) -> int:
        """Scalar reads plus ``tolist`` calls seen so far."""
        return self._scalars.count + self._lists.count


def count_syncs(fn: Callable[[], object], steps: int) -> float:
    """Host syncs per call of ``fn``, averaged over ``steps`` calls (see :class:`SyncCounter`).

    Cost: whatever ``fn`` costs, ``steps`` times, plus the counter's per-op overhead.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    with SyncCounter() as counter:
        for _ in range(steps):
            fn()
    return counter.count / steps
