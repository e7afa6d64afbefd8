"""The flight recorder's ring buffer: the last N windows' signals, on the device.

Every field is a preallocated device tensor written at a Python-int index (``row = step % N``),
so recording costs small device ops and no host sync; what the host knows anyway (the step
number, the LR of every param group) is kept on the host. Per window:

========================  =========================================================
``loss``                  the window's mean loss
``bound``                 the spike detector's bound for it (inf while warming up)
``level``                 the detector's running level of the loss (``exp`` of the mean log-loss)
``spike``                 1.0 where the detector flagged the window
``status``                the window's packed flags (``ampguard.core.results.pack``)
``scale``                 the loss scale the window ran with (1.0 without a scale)
``grad_norm`` [N, P]      per-parameter gradient norm (unscaled, before clipping)
``update_ratio`` [N, P]   per-parameter ||update|| / ||weight|| (the RMS ratio), sampled windows
``amax`` [N, M]           per-module output amax, sampled windows
``lr`` (host)             the LR of every param group
========================  =========================================================

Unsampled rows hold NaN. Memory: ``N * (6 + 2 P + M)`` floats on the device (N=256, 100
parameters, 50 modules: about 0.3 MB). Reading it (:meth:`FlightRecorder.rows`) is one host sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["FlightRecorder"]

_SCALARS = ("loss", "bound", "level", "spike", "status", "scale")


class FlightRecorder:
    """A ring of ``capacity`` windows for the parameters ``names`` and the modules ``modules``
    (see the module docstring)."""

    def __init__(
        self, capacity: int, names: list[str], modules: list[str], device: torch.device
    ) -> None:
        self.capacity = capacity
        self.names = list(names)
        self.modules = list(modules)
        self.device = device
        f32 = {"dtype": torch.float32, "device": device}
        self.scalars = torch.full((len(_SCALARS), capacity), math.nan, **f32)
        self.grad_norm = torch.full((capacity, len(names)), math.nan, **f32)
        self.update_ratio = torch.full((capacity, len(names)), math.nan, **f32)
        self.amax = torch.full((capacity, max(len(modules), 1)), math.nan, **f32)
        self.steps: list[int | None] = [None] * capacity  # host: the step in each row
        self.lr: list[list[float] | None] = [None] * capacity

    def row(self, step: int) -> int:
        """The row window ``step`` is (or will be) written to."""
        return step % self.capacity

    def start(self, step: int, lr: list[float]) -> int:
        """Open window ``step``'s row: clears what an older window left in it. Cost: three fill
        kernels, no host sync."""
        r = self.row(step)
        self.steps[r] = step
        self.lr[r] = lr
        self.scalars[:, r].fill_(math.nan)
        self.update_ratio[r].fill_(math.nan)
        self.amax[r].fill_(math.nan)
        return r

    def put(self, step: int, field: str, value: torch.Tensor) -> None:
        """Write the 0-dim ``value`` as window ``step``'s ``field`` (one of ``loss``, ``bound``,
        ``level``, ``spike``, ``status``, ``scale``). Cost: one copy kernel, no host sync."""
        self.scalars[_SCALARS.index(field), self.row(step)].copy_(value.detach().reshape(()))

    def put_grad_norms(self, step: int, grads: list[torch.Tensor | None], inv: Any) -> None:
        """Per-parameter gradient norms (``inv``: a factor that unscales them, or None).
        Parameters without a gradient read NaN. Cost: one multi-tensor norm, no host sync."""
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return
        norms = torch._foreach_norm([grads[i] for i in present])  # type: ignore[misc]
        values = torch.stack([n.float() for n in norms])
        if inv is not None:
            values = values * inv
        target = self.grad_norm[self.row(step)]
        if len(present) == len(grads):
            target.copy_(values)
        else:
            target.index_copy_(0, torch.tensor(present, device=self.device), values)

    def put_vector(self, step: int, field: str, values: torch.Tensor) -> None:
        """Write a per-parameter (``update_ratio``) or per-module (``amax``) row. Cost: one
        copy kernel."""
        getattr(self, field)[self.row(step)].copy_(values)

    def rows(self) -> list[dict[str, Any]]:
        """The recorded windows, oldest first, as host dicts (``step``, ``lr``, the scalars,
        ``grad_norm`` / ``update_ratio`` / ``amax`` as lists; NaN as None). Cost: one host
        sync (a copy of the whole ring)."""
        order = sorted((s, r) for r, s in enumerate(self.steps) if s is not None)
        if not order:
            return []
        idx = [r for _, r in order]
        host = {
            "scalars": self.scalars[:, idx].cpu().tolist(),
            "grad_norm": self.grad_norm[idx].cpu().tolist(),
            "update_ratio": self.update_ratio[idx].cpu().tolist(),
            "amax": self.amax[idx].cpu().tolist(),
        }
        out = []
        for k, (step, r) in enumerate(order):
            rec: dict[str, Any] = {"step": step, "lr": self.lr[r]}
            for j, name in enumerate(_SCALARS):
                rec[name] = _num(host["scalars"][j][k])
            rec["grad_norm"] = [_num(v) for v in host["grad_norm"][k]]
            rec["update_ratio"] = [_num(v) for v in host["update_ratio"][k]]
            rec["amax"] = [_num(v) for v in host["amax"][k]][: len(self.modules)]
            out.append(rec)
        return out

    def memory_bytes(self) -> int:
        """Device bytes held by the ring."""
        return 4 * (self.scalars.numel() + 2 * self.grad_norm.numel() + self.amax.numel())


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None
