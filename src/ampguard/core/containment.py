"""Micro-batch containment: drop a non-finite micro-batch, keep the rest of the window.

Each micro-batch's gradients are checked on the device and added to an accumulation buffer only
when finite; at the end of the window the buffer is rescaled to the mean over the good
micro-batches. One extra gradient buffer; no host sync.
"""

from __future__ import annotations

import torch

__all__ = ["MicrobatchBuffer"]


class MicrobatchBuffer:
    """Accumulates finite micro-batch gradients of ``params`` over a window of ``window``."""

    def __init__(self, params: list[torch.Tensor], window: int) -> None:
        device = params[0].device
        self.window = window
        self._acc: dict[int, torch.Tensor] = {}
        self._good = torch.zeros((), dtype=torch.float32, device=device)
        self._dropped = torch.zeros((), dtype=torch.int64, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._fresh = True
        self._seen: set[int] = set()

    def _start_window(self) -> None:
        if self._acc:
            torch._foreach_zero_(list(self._acc.values()))
        self._good.zero_()
        self._dropped.zero_()
        self._seen.clear()
        self._fresh = False

    def absorb(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Move this micro-batch's gradients into the buffer (or drop them); clears ``.grad``.
        Returns the 0-dim bool device flag "this micro-batch was dropped" (no host sync)."""
        if self._fresh:
            self._start_window()
        live = [p for p in params if p.grad is not None]
        self._seen.update(id(p) for p in live)
        grads = [p.grad for p in live if p.grad is not None]  # all of them: typed Tensor
        bad = torch.zeros((), dtype=torch.float32, device=self._good.device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, bad, self._one)
        is_bad = bad > 0
        masked = [torch.where(is_bad, 0.0, g) for g in grads]
        acc = [self._buffer(p) for p in live]
        if acc:
            torch._foreach_add_(acc, masked)
        self._good.add_(1.0 - is_bad.float())
        self._dropped.add_(is_bad.long())
        for p in live:
            p.grad = None
        return is_bad

    def install(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the window's mean over good micro-batches into ``.grad``.

        Returns ``(dropped, all_dropped)`` device scalars; when every micro-batch was dropped the
        gradients are zero and the caller must skip the step.
        """
        factor = self.window / self._good.clamp(min=1.0)
        live = [p for p in params if id(p) in self._seen]
        if live:
            torch._foreach_mul_([self._acc[id(p)] for p in live], factor)
        for p in live:
            p.grad = self._acc[id(p)]
        self._fresh = True
        return self._dropped.clone(), (self._good == 0).float()

    def buffers(self) -> list[torch.Tensor]:
        """The accumulation buffers (the window's good micro-batches so far)."""
        return list(self._acc.values())

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        buf = self._acc.get(id(p))
        if buf is None:
            buf = self._acc[id(p)] = torch.zeros_like(p)
        return buf
