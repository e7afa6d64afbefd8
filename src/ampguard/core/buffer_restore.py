"""A skipped step leaves no trace: the buffers a window's forward changed go back when it skips.

When the Guard skips a step (an fp16 overflow, non-finite gradients under bf16/fp32), the
forward of that window has already run, and a forward updates module buffers in place:
BatchNorm's ``running_mean`` / ``running_var`` / ``num_batches_tracked``, an EMA kept as a
buffer, a step counter. An overflowing forward writes inf/NaN there; training looks fine (the
train-mode forward uses the batch statistics), but every later eval is NaN.

:class:`BufferSnapshot` keeps one preallocated copy of the model's buffers::

    first forward of a window (Guard.autocast, micro-batch 0):  copy buffers -> snapshot
    window skipped, flags on the host:      copy snapshot -> buffers         (one foreach copy)
    window skipped, flags on the device (fused optimizers, read lazily):
                                            buffer = where(skipped, snapshot, buffer)  (no sync)

Every buffer with elements is kept, whatever its dtype (floating and integer buffers alike), so
no forward's in-place update escapes; parameters are not buffers and are never touched (a
skipped step does not change them). Buffers are collected when the Guard is built; a buffer
that a module later *replaces* by a new tensor object (instead of updating it in place, as
BatchNorm does) is not followed. ``Guard(restore_buffers_on_skip=False)`` turns this off.

Cost: per window one multi-tensor copy of the buffers (BatchNorm statistics are a few floats
per channel: far below one step's work); on a skip one more copy (host-known flags) or one
``where`` per buffer (lazy fused flags); no host sync, no allocation after the first window.
"""

from __future__ import annotations

import torch

__all__ = ["BufferSnapshot", "collect_buffers"]


def collect_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The distinct non-empty buffers of ``model`` (shared buffers once), in module order."""
    seen: set[int] = set()
    out = []
    for buf in model.buffers():
        if buf.numel() and id(buf) not in seen:
            seen.add(id(buf))
            out.append(buf)
    return out


class BufferSnapshot:
    """One preallocated copy of a model's buffers, taken once per window and put back on a skip.

    ``take(window)`` copies the buffers unless this window's copy was already taken (the first
    forward of the window wins; later micro-batches and repeated forwards do not overwrite it).
    ``restore(window)`` puts the copy back; ``restore_where(window, skipped)`` does it on
    the device from a 0-dim bool flag, without a host sync. ``restored`` counts host-known
    restores (lazy ones are not: counting them would need the flag on the host).
    Cost: see the module docstring.
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self._copies = [torch.empty_like(b) for b in buffers]
        self._window: int | None = None
        self.restored = 0

    @classmethod
    def of(cls, model: torch.nn.Module) -> BufferSnapshot | None:
        """A snapshot of ``model``'s buffers, or None when it has none (then nothing costs)."""
        buffers = collect_buffers(model)
        return cls(buffers) if buffers else None

    @property
    def window(self) -> int | None:
        """The window (Guard step number) whose copy is held, or None before the first."""
        return self._window

    def take(self, window: int) -> None:
        """Copy the buffers for ``window`` unless already done. Cost: one multi-tensor copy."""
        if self._window == window:
            return
        with torch.no_grad():
            torch._foreach_copy_(self._copies, self.buffers)
        self._window = window

    def restore(self, window: int) -> None:
        """Put the copy back: ``window`` was skipped. A copy of another window (its forward ran
        outside ``Guard.autocast``, so no copy was taken) is never put back. Cost: one
        multi-tensor copy."""
        if self._window != window:
            return
        with torch.no_grad():
            torch._foreach_copy_(self.buffers, self._copies)
        self.restored += 1

    def restore_where(self, window: int, skipped: torch.Tensor) -> None:
        """Put the copy back where the 0-dim bool device tensor ``skipped`` is true (the
        window's flags are still on the device). As :meth:`restore`, only the copy of
        ``window`` goes back. Cost: one ``where`` per buffer on the device; no host sync.
        """
        if self._window != window:
            return
        with torch.no_grad():
            for buf, copy in zip(self.buffers, self._copies, strict=True):
                buf.copy_(torch.where(skipped.to(buf.device), copy, buf))
