"""A skipped step leaves no trace: the buffers a window's forward changed go back when it skips.

When the Guard skips a step (an fp16 overflow, non-finite gradients under bf16/fp32), the
forward of that window has already run, and a forward updates module buffers in place:
BatchNorm's ``running_mean`` / ``running_var`` / ``num_batches_tracked``, an EMA kept as a
buffer, a step counter. An overflowing forward writes inf/NaN there; training looks fine (the
train-mode forward uses the batch statistics), but every later eval is NaN.

:class:`BufferSnapshot` keeps one preallocated copy of the model's buffers::

    first forward of a window (Guard.autocast, micro-batch 0):  copy buffers -> snapshot
    window skipped, flags on the host:      copy snapshot -> buffers         (one foreach copy)
    window skipped, flags on the device (fused optimizers, read lazily), every window:
                                            buffers = where(skipped, snapshot, buffers)  (no sync;
                                            one cat + where + foreach copy per dtype group)

Every (contiguous) buffer with elements is kept, whatever its dtype (floating and integer
buffers alike), so no forward's in-place update escapes; parameters are not buffers and are
never touched (a skipped step does not change them). Buffers are collected when the Guard is
built and checked again at the first forward of every window (an identity check of
``model.buffers()``: the same tensor objects on the same storage): a buffer registered or
replaced by a new tensor after the Guard was built, or every buffer after ``model.double()`` /
``model.to(...)``, is re-collected then, so the promise holds from that window on (a buffer
replaced in the middle of a window is followed from the next one).
``Guard(restore_buffers_on_skip=False)`` turns this off.

Cost: per window one pass over ``model.buffers()`` (Python only, no device work) and one
multi-tensor copy of the buffers (BatchNorm statistics are a few floats per channel: far below
one step's work); a re-collection allocates the copy again; on a host-known skip one more
copy. With fused optimizers, whose skip is known only on the device, every window also runs the
lazy restore: a ``cat``, a ``where`` and a multi-tensor copy per dtype group (about 30 us on a
CPU, where each op costs several microseconds; asynchronous launches on a GPU). No host sync.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

__all__ = ["BufferSnapshot", "collect_buffers"]


def collect_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The distinct non-empty contiguous buffers of ``model`` (shared buffers once), in module
    order (a non-contiguous buffer, which no torch module makes, is left out)."""
    seen: set[int] = set()
    out = []
    for buf in model.buffers():
        if buf.numel() and buf.is_contiguous() and id(buf) not in seen:
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

    def __init__(self, buffers: list[torch.Tensor], model: torch.nn.Module | None = None) -> None:
        self._model = weakref.ref(model) if model is not None else None
        self.recollected = 0  # times the buffers were collected again (see refresh)
        self._window: int | None = None
        self.restored = 0
        self._build(buffers)

    def _build(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self._ptrs = [b.data_ptr() for b in buffers]
        # one flat copy per (device, dtype) group: the lazy restore is then a constant number of
        # ops per group (cat, where, one multi-tensor copy) whatever the number of buffers;
        # ``_copies[i]`` is buffer i's view into its group's flat storage
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, b in enumerate(buffers):
            groups.setdefault((b.device, b.dtype), []).append(i)
        self._copies: list[torch.Tensor] = [torch.empty(0)] * len(buffers)
        self._groups: list[_Group] = []
        for (device, dtype), idx in groups.items():
            sizes = [buffers[i].numel() for i in idx]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            for i, part in zip(idx, flat.split(sizes), strict=True):
                self._copies[i] = part.view(buffers[i].shape)
            flats = [buffers[i].view(-1) for i in idx]  # contiguous (checked in collect)
            self._groups.append(_Group(flat, flats, sizes))

    @classmethod
    def of(cls, model: torch.nn.Module) -> BufferSnapshot:
        """A snapshot of ``model``'s buffers that follows the model (:meth:`refresh`); a model
        without buffers costs one pass over ``model.buffers()`` per window until it has one."""
        return cls(collect_buffers(model), model)

    def refresh(self) -> bool:
        """Collect the model's buffers again when they are not the ones held (registered,
        replaced, moved or cast since): True when it did. Cost: one pass over
        ``model.buffers()``; a re-collection allocates the copy again. No host sync."""
        model = self._model() if self._model is not None else None
        if model is None:
            return False
        current = collect_buffers(model)
        if len(current) == len(self.buffers) and all(
            a is b and a.data_ptr() == p
            for a, b, p in zip(current, self.buffers, self._ptrs, strict=True)
        ):
            return False
        self._build(current)
        self.recollected += 1
        return True

    @property
    def window(self) -> int | None:
        """The window (Guard step number) whose copy is held, or None before the first."""
        return self._window

    def take(self, window: int) -> None:
        """Copy the buffers for ``window`` unless already done. Cost: one multi-tensor copy."""
        if self._window == window:
            return
        self.refresh()
        if self.buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._copies, self.buffers)
        self._window = window

    def restore(self, window: int) -> None:
        """Put the copy back: ``window`` was skipped. A copy of another window (its forward ran
        outside ``Guard.autocast``, so no copy was taken) is never put back. Cost: one
        multi-tensor copy."""
        if self._window != window or not self.buffers:
            return
        with torch.no_grad():
            torch._foreach_copy_(self.buffers, self._copies)
        self.restored += 1

    def restore_where(self, window: int, skipped: torch.Tensor) -> None:
        """Put the copy back where the 0-dim bool device tensor ``skipped`` is true (the
        window's flags are still on the device). As :meth:`restore`, only the copy of
        ``window`` goes back. Cost: per (device, dtype) group of buffers one ``cat``, one
        ``where`` and one multi-tensor copy on the device; no host sync.
        """
        if self._window != window:
            return
        with torch.no_grad():
            for g in self._groups:
                back = torch.where(skipped.to(g.flat.device), g.flat, torch.cat(g.views))
                torch._foreach_copy_(g.views, back.split(g.sizes))


class _Group(NamedTuple):
    """Buffers of one (device, dtype): their flat copy, flat views of them, their sizes."""

    flat: torch.Tensor
    views: list[torch.Tensor]
    sizes: list[int]
