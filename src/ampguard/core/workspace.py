"""fp32 working tensors that keep their views between steps and their memory only during one.

A rescued step needs fp32 copies of each weight, gradient and low-precision state of a group.
Making them anew each step costs an allocation or a view per tensor (on a small model, more
than the arithmetic); keeping them costs 4 bytes per element between steps. A
:class:`Workspace` keeps the *tensors* (views of one flat fp32 buffer, in a fixed layout) and
frees their *memory* between steps, as FSDP frees an unsharded parameter: :meth:`acquire`
grows the flat buffer's storage back (one allocation), :meth:`release` shrinks it to 0 bytes.
Nothing is kept but the tensor objects: outside a step they have no memory, and reading one
then reads freed memory (only this package holds them; a reference taken to one retires the
workspace, below).

:meth:`release` frees the memory only when nothing else holds it: no other tensor shares the
storage (the storage's use count, ``torch._C._storage_Use_Count``) and no one kept a reference
to one of the views (each view's reference count, as it was when made). An optimizer that
stored a gradient or a weight in its state, say, keeps that memory: the workspace is then
retired (:attr:`retired`) with its memory alive, and its owner makes a new one. Where the
storage's use count cannot be read (a torch without that function) or the storage cannot be
resized (a device that does not allow it), :func:`workspace` returns None and the caller makes
fresh tensors each step, as without a workspace.

Cost: one allocation per :meth:`acquire`, a reference count per view per :meth:`release`; no
tensor operation, no host sync.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

__all__ = ["Workspace", "Reusable", "workspace", "contiguous_geometry", "views", "Geometry"]

Geometry = list[tuple[Any, tuple[int, ...], int]]  # (shape, strides, offset) of each view

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def contiguous_geometry(shapes: list[Any], start: int = 0) -> Geometry:
    """``(shape, contiguous strides, offset)`` of each shape laid out one after another in a
    flat buffer from element ``start``."""
    out, offset = [], start
    for shape in shapes:
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        out.append((shape, tuple(reversed(strides)), offset))
        offset += math.prod(shape)
    return out


def views(flat: torch.Tensor, geometry: Geometry) -> list[torch.Tensor]:
    """The views of ``flat`` that ``geometry`` describes (one ``as_strided`` each)."""
    return [flat.as_strided(shape, strides, offset) for shape, strides, offset in geometry]


class Workspace:
    """A flat fp32 buffer of ``numel`` elements on ``device`` and the views ``geometry``
    describes (:attr:`views`), made once; its memory exists between :meth:`acquire` and
    :meth:`release`. Use :func:`workspace` to make one."""

    def __init__(self, numel: int, geometry: Geometry, device: Any) -> None:
        self.flat = torch.empty(numel, dtype=torch.float32, device=device)
        self.views = views(self.flat, geometry)
        self.storage = self.flat.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.retired = False
        self._refs = self._counts()  # what holds the memory at rest: this object alone
        self.storage.resize_(0)

    def _counts(self) -> tuple[int, list[int]]:
        assert _use_count is not None
        return _use_count(self.storage._cdata), list(map(sys.getrefcount, self.views))

    def acquire(self) -> list[torch.Tensor]:
        """Give the views their memory back (uninitialised) and return them. Cost: one
        allocation."""
        if self.storage.nbytes() != self.nbytes:
            self.storage.resize_(self.nbytes)
        return self.views

    def release(self) -> bool:
        """Free the memory if nothing but this workspace holds it and return True; else
        retire the workspace (its memory stays with whoever holds it) and return False. Call
        it once every reference the step made is dropped."""
        if self._counts() != self._refs:
            self.retired = True
            return False
        self.storage.resize_(0)
        return True


def workspace(numel: int, geometry: Geometry, device: Any) -> Workspace | None:
    """A :class:`Workspace`, or None where the storage's use count cannot be read or the
    device does not let a storage be resized (the caller then makes fresh tensors)."""
    if _use_count is None:
        return None
    try:
        return Workspace(numel, geometry, device)
    except (RuntimeError, NotImplementedError):  # a storage this device cannot resize
        return None  # the documented fallback: fresh tensors each step, as without one


class Reusable:
    """The :class:`Workspace` of one layout, made on first use and made again once retired; None
    for good where none can be made (or there is nothing to hold: ``numel`` 0)."""

    def __init__(self, numel: int, geometry: Geometry, device: Any) -> None:
        self._args = (numel, geometry, device)
        self._ws: Workspace | None = None
        self._failed = numel == 0

    def get(self) -> Workspace | None:
        """The workspace (made now if there is none or it was retired). Cost: none, or the
        making of one."""
        if (self._ws is None or self._ws.retired) and not self._failed:
            self._ws = workspace(*self._args)
            self._failed = self._ws is None
        return self._ws
