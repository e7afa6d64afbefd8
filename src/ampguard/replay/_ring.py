"""The flight recorder's ring buffer: the last N windows' signals, on the device.

Every field is a preallocated device tensor written at a Python-int index (``row = step % N``),
so recording costs small device ops and no host sync; what the host knows anyway (the step
number, the LR of every param group) is kept on the host. Per window:

========================  =========================================================
``loss``                  the window's mean loss
``log_bound``             the spike detector's bound for its log-loss (inf while warming up)
``mean``                  the detector's running mean of the log-loss (the level: its ``exp``)
``spike``                 1.0 where the detector flagged the window
``status``                the window's packed flags (``ampguard.core.results.pack``)
``scale``                 the loss scale the window ran with (1.0 without a scale)
``grad_norm`` [N, P]      per-parameter gradient norm (unscaled, before clipping)
``update_ratio`` [N, P]   per-parameter ||update|| / ||weight|| (the RMS ratio), sampled windows
``amax`` [N, M]           per-module output amax (the Guard does not write it yet: None)
``lr`` (host)             the LR of every param group
========================  =========================================================

What a row did not record reads None (the host keeps which fields each row holds). Memory:
``N * (6 + 2 P + M)`` floats on the device (N=256, 100 parameters, 50 modules: about 0.3 MB).
Reading it (:meth:`FlightRecorder.rows`) is one host sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["FlightRecorder"]

_SCALARS = ("loss", "log_bound", "mean", "spike", "status", "scale")  # a row of ``scalars``


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
        f32: dict[str, Any] = {"dtype": torch.float32, "device": device}
        self.scalars = torch.full((capacity, len(_SCALARS)), math.nan, **f32)
        self.grad_norm = torch.full((capacity, len(names)), math.nan, **f32)
        self.update_ratio = torch.full((capacity, len(names)), math.nan, **f32)
        self.amax = torch.full((capacity, max(len(modules), 1)), math.nan, **f32)
        # host: the step in each row, its LRs, and which optional fields it holds
        self.steps: list[int | None] = [None] * capacity
        self.lr: list[list[float] | None] = [None] * capacity
        self.has: list[set[str]] = [set() for _ in range(capacity)]

    def row(self, step: int) -> int:
        """The row window ``step`` is (or will be) written to."""
        return step % self.capacity

    def start(self, step: int, lr: list[float]) -> torch.Tensor:
        """Open window ``step``'s row; returns the device view the detector writes
        ``[loss, log bound, mean, spike]`` into. Cost: none (host bookkeeping, a view)."""
        r = self.row(step)
        self.steps[r] = step
        self.lr[r] = lr
        self.has[r] = set()
        return self.scalars[r, :4]

    def put(self, step: int, field: str, value: torch.Tensor) -> None:
        """Write the 0-dim ``value`` as window ``step``'s ``field`` (``status`` or ``scale``).
        Cost: one copy kernel, no host sync."""
        r = self.row(step)
        self.scalars[r, _SCALARS.index(field)].copy_(value.detach().reshape(()))
        self.has[r].add(field)

    def put_grad_norms(self, step: int, grads: list[torch.Tensor | None], inv: Any) -> None:
        """Per-parameter gradient norms (``inv``: a factor that unscales them, or None).
        Parameters without a gradient read NaN. Cost: one multi-tensor norm and a stack, no
        host sync."""
        r = self.row(step)
        present = [g for g in grads if g is not None]
        if not present:
            return
        if all(g.dtype == torch.float32 for g in present):
            norms = torch._foreach_norm(present)
        else:  # low-precision gradients: their norms in fp32
            norms = torch._foreach_norm(present, 2, dtype=torch.float32)
        target = self.grad_norm[r]
        if len(present) == len(grads):
            torch.stack(norms, out=target)
        else:
            idx = [i for i, g in enumerate(grads) if g is not None]
            target.fill_(math.nan)
            target.index_copy_(0, torch.tensor(idx, device=self.device), torch.stack(norms))
        if inv is not None:
            target.mul_(inv)
        self.has[r].add("grad_norm")

    def put_vector(self, step: int, field: str, values: torch.Tensor) -> None:
        """Write a per-parameter (``update_ratio``) or per-module (``amax``) row. Cost: one
        copy kernel."""
        r = self.row(step)
        getattr(self, field)[r].copy_(values)
        self.has[r].add(field)

    def rows(self) -> list[dict[str, Any]]:
        """The recorded windows, oldest first, as host dicts: ``step``, ``lr``, ``loss``,
        ``bound`` (the loss above which it spikes), ``level`` (the running level of the loss),
        ``spike``, ``status``, ``scale``, and ``grad_norm`` / ``update_ratio`` / ``amax`` as
        lists; what was not recorded (or non-finite) is None. Cost: one host sync (a copy of the
        whole ring)."""
        order = sorted((s, r) for r, s in enumerate(self.steps) if s is not None)
        if not order:
            return []
        idx = [r for _, r in order]
        host = (
            torch.cat(
                [self.scalars[idx], self.grad_norm[idx], self.update_ratio[idx], self.amax[idx]],
                dim=1,
            )
            .cpu()
            .tolist()
        )
        p, k = len(self.names), len(_SCALARS)
        out = []
        for values, (step, r) in zip(host, order, strict=True):
            loss, log_bound, mean, spike, status, scale = values[:k]
            has = self.has[r]
            out.append(
                {
                    "step": step,
                    "lr": self.lr[r],
                    "loss": _num(loss),
                    "bound": _num(math.exp(log_bound) if math.isfinite(log_bound) else math.inf),
                    "level": _num(math.exp(mean) if math.isfinite(mean) else math.nan),
                    "spike": _num(spike),
                    "status": _num(status) if "status" in has else None,
                    "scale": _num(scale) if "scale" in has else None,
                    "grad_norm": [_num(v) for v in values[k : k + p]]
                    if "grad_norm" in has
                    else [None] * p,
                    "update_ratio": [_num(v) for v in values[k + p : k + 2 * p]]
                    if "update_ratio" in has
                    else [None] * p,
                    "amax": [_num(v) for v in values[k + 2 * p :]][: len(self.modules)]
                    if "amax" in has
                    else [None] * len(self.modules),
                }
            )
        return out

    def recorded(self, step: int) -> tuple[float, float, float] | None:
        """``(loss, bound, level)`` of window ``step`` if it is still in the ring. Cost: one host
        sync."""
        r = self.row(step)
        if self.steps[r] != step:
            return None
        loss, log_bound, mean = self.scalars[r, :3].tolist()
        return loss, math.exp(log_bound), math.exp(mean)

    def memory_bytes(self) -> int:
        """Device bytes held by the ring."""
        return 4 * (self.scalars.numel() + 2 * self.grad_norm.numel() + self.amax.numel())


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None
