"""Per-module output amax on sampled windows: forward hooks that exist only while sampling.

The flight recorder's ``amax`` field: for every module that owns parameters (the layers:
``Linear``, ``LayerNorm``, ``Embedding``, HF's ``Conv1D``...), the largest ``|output|`` of the
window's training forward passes (grad enabled; every micro-batch of the window; the first
tensor of a tuple or mapping output). :meth:`OutputAmax.arm` registers one forward hook per
module just before a sampled window's forward, and :meth:`OutputAmax.finish` removes them when
the window reaches ``Guard.step()``, so the other windows run the model without any hook
(a module with a hook takes torch's slow call path).

Cost on a sampled window: one ``aminmax`` per module call (no allocation of the activation's
size, no host sync) and, at the window's end, four small ops writing the ring's row; the hooks'
Python call (a few microseconds per module) and their registration. On the other windows:
nothing. A non-finite output reads None in the ring (as every non-finite value does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["OutputAmax", "layers_of"]


def layers_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that own parameters (``recurse=False``), in ``named_modules``
    order, with their names."""
    return [
        (name or type(model).__name__, mod)
        for name, mod in model.named_modules()
        if next(mod.parameters(recurse=False), None) is not None
    ]


class OutputAmax:
    """Samples the output amax of :func:`layers_of` ``model`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        found = layers_of(model)
        self.names = [n for n, _ in found]
        self._modules = [m for _, m in found]
        self._handles: list[Any] = []
        self._max: dict[int, torch.Tensor] = {}  # module index -> running max (0-dim)
        self._min: dict[int, torch.Tensor] = {}
        self.step: int | None = None  # the window armed

    @property
    def armed(self) -> bool:
        """Hooks are registered (a sampled window's forward is being recorded)."""
        return bool(self._handles)

    def arm(self, step: int) -> None:
        """Register the hooks for window ``step``'s forward passes. Cost: one hook per module."""
        self.close()
        self.step = step
        for i, mod in enumerate(self._modules):
            self._handles.append(mod.register_forward_hook(self._hook(i, mod)))

    def _hook(self, i: int, module: torch.nn.Module) -> Any:
        maxes, mins = self._max, self._min

        def hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
            # a deep copy of the model (a replay) carries this function: only the live module
            if mod is not module or not torch.is_grad_enabled():
                return
            t = _first_tensor(output)
            if t is None:
                return
            lo, hi = torch.aminmax(t.detach())
            if i in maxes:
                torch.maximum(maxes[i], hi, out=maxes[i])
                torch.minimum(mins[i], lo, out=mins[i])
            else:
                maxes[i], mins[i] = hi.float(), lo.float()

        return hook

    def finish(self, step: int, ring: Any) -> None:
        """Window ``step`` reached ``Guard.step()``: remove the hooks and, if they recorded
        this window, write its row into ``ring`` (a :class:`~ampguard.replay.FlightRecorder`).
        Cost: four small device ops, no host sync."""
        if not self._handles:
            return
        recorded = self.step == step and bool(self._max)
        maxes, mins = dict(self._max), dict(self._min)
        self.close()
        if not recorded:
            return
        nan = ring.nan
        n = len(self.names)
        hi = torch.stack([maxes.get(i, nan) for i in range(n)])
        lo = torch.stack([mins.get(i, nan) for i in range(n)])
        ring.put_sampled(step, "amax", torch.maximum(hi, lo.neg_()))

    def close(self) -> None:
        """Remove the hooks (the next window runs without them)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._max.clear()
        self._min.clear()
        self.step = None


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The floating-point tensor a module's output stands for: itself, the first tensor of a
    tuple / list, or the first tensor value of a mapping (HF's ``ModelOutput``)."""
    if isinstance(output, (tuple, list)):
        output = next((o for o in output if isinstance(o, torch.Tensor)), None)
    elif isinstance(output, Mapping):
        output = next((o for o in output.values() if isinstance(o, torch.Tensor)), None)
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        return None
    if output.numel() == 0:
        return None
    to_local = getattr(output, "to_local", None)  # a DTensor output: this rank's part
    return to_local() if callable(to_local) else output
