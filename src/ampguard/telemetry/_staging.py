"""Device-to-host staging for telemetry flushes: a flush on CUDA costs no host sync.

A flush copies the device record buffer into a preallocated host buffer. On CUDA the host
buffer is pinned, the copy is ``non_blocking`` on the current stream and an event is recorded
after it; the rows are handed back (:meth:`HostStaging.ready`) once the event has completed,
normally at the next flush, or when the caller must have them (``wait=True``: a public flush,
findings, close). Anywhere else (CPU) the copy is a plain synchronous memcpy and the rows are
ready at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["HostStaging"]


class HostStaging:
    """Preallocated host buffers of ``numel`` fp32 values for copies of a device buffer.

    Cost: :meth:`push` queues one device-to-host copy (no sync on CUDA); :meth:`ready` syncs
    only with ``wait=True`` (or when every host buffer is still in flight), else none.
    """

    def __init__(self, numel: int, device: torch.device) -> None:
        self.asynchronous = device.type == "cuda" and torch.cuda.is_available()
        count = 2 if self.asynchronous else 1  # one in flight while the next fills
        self._free = [
            torch.empty(numel, dtype=torch.float32, pin_memory=self.asynchronous)
            for _ in range(count)
        ]
        self._pending: deque[tuple[Any, torch.Tensor, int, Any]] = deque()

    @property
    def in_flight(self) -> int:
        """Copies pushed whose rows were not handed back yet."""
        return len(self._pending)

    def push(self, src: torch.Tensor, payload: Any) -> None:
        """Queue a copy of the 1-D ``src`` with ``payload``; call :meth:`ready` first so that
        a host buffer is free (it waits for the oldest copy if none is)."""
        if not self._free:
            raise RuntimeError("HostStaging.push: every host buffer is in flight; drain first")
        host = self._free.pop()
        n = src.numel()
        if self.asynchronous:
            host[:n].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(src.device))  # the stream the copy is on
        else:
            host[:n].copy_(src)
            event = None
        self._pending.append((event, host, n, payload))

    def ready(self, wait: bool = False) -> Iterator[tuple[np.ndarray, Any]]:
        """Yield ``(host values, payload)`` of completed copies, oldest first, and free their
        buffers once the consumer moves on. ``wait``: also wait for the copies in flight;
        without it a copy is waited for only when no host buffer would be left free."""
        while self._pending:
            event, host, n, payload = self._pending[0]
            if event is not None and not event.query():
                if not (wait or not self._free):
                    return
                event.synchronize()
            self._pending.popleft()
            try:
                yield host[:n].numpy(), payload
            finally:
                self._free.append(host)
