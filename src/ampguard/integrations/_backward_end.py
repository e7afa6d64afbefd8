"""Gradient samples at the end of each backward pass, for loops ampguard watches without a scaler.

Without a ``GradScaler`` there is no ``unscale_`` to tap, and by the time the optimizer's pre-step
hook runs, the loop (or the framework) has usually clipped the gradients already, so a sample
taken there is the *post*-clip norm (flat at the clip value whenever clipping binds). This hook
samples at the end of every backward pass instead: ``post_accumulate_grad`` hooks on the
parameters note that a backward is running and queue one autograd engine callback, which runs
when the whole backward has finished, before anything can clip. The last backward of an
accumulation window leaves the sample the step is recorded with. Gradients are read, never
written; no host sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ampguard.core.loss_scale import check_grads
from ampguard.core.scaler import collect_grads

__all__ = ["BackwardEnd", "nonfinite_flag"]


class BackwardEnd:
    """Calls ``fn()`` once at the end of every backward pass that reaches ``params``.

    Cost: one cheap Python call per parameter per backward pass, one engine callback per
    backward pass, plus what ``fn`` does; no host sync.
    """

    def __init__(self, params: Sequence[torch.Tensor], fn: Callable[[], None]) -> None:
        self._fn = fn
        self._queued = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._grad_ready)
            for p in params
            if p.requires_grad
        ]

    def _grad_ready(self, _param: Any) -> None:
        if self._queued:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._done)

    def _done(self) -> None:
        self._queued = False
        self._fn()

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def nonfinite_flag(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-dim flag, nonzero when a gradient of ``params`` holds NaN/inf. Cost: no host sync."""
    grads = collect_grads(params)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return check_grads(grads, device)
