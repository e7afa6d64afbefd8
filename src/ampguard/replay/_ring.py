"""The flight recorder's ring buffer: the last N windows' signals, on the device.

Every field is a preallocated device tensor written at a Python-int index (``row = step % N``),
so recording costs a few device ops and no host sync; what the host knows anyway (the step
number, float LRs) is kept on the host. Per window:

========================  =========================================================
``loss``                  the window's mean loss
``log_bound``             the spike detector's bound for its log-loss (inf while warming up)
``mean``                  the detector's running mean of the log-loss (the level: its ``exp``)
``spike``                 1.0 where the detector flagged the window
``status``                the window's packed flags (``ampguard.core.results.pack``)
``scale``                 the loss scale the window ran with (1.0 without a scale)
``grad_norm`` [N, P]      per-parameter gradient norm (unscaled, before clipping; FSDP2: the
                          rank's shard)
``lr`` [N, G]             the LR of every param group: a tensor LR is copied on the device, a
                          float LR is kept on the host (no sync either way)
``update_ratio`` [N, P]   per-parameter ||update|| / ||weight|| (the RMS ratio), sampled windows
``amax`` [N, M]           per-module output amax (max |output|), sampled windows
========================  =========================================================

One window's row (the scalars, the gradient norms and the tensor LRs) is staged as the step
produces it and written by ONE ``torch.stack`` into the table at the row (:meth:`commit`); the
sampled fields are one more copy each on sampled windows. What a row did not record reads None
(the host keeps which fields each row holds). Memory: ``N * (6 + G + 2 P + M)`` floats on the
device (N=256, 100 parameters, 50 modules: about 0.3 MB). Reading it (:meth:`rows`) is one host
sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["FlightRecorder", "local"]

_SCALARS = ("loss", "log_bound", "mean", "spike", "status", "scale")  # a row of ``scalars``
_K = len(_SCALARS)


class FlightRecorder:
    """A ring of ``capacity`` windows for the parameters ``names``, the modules ``modules`` and
    ``groups`` param groups (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        names: list[str],
        modules: list[str],
        device: torch.device,
        groups: int = 0,
    ) -> None:
        self.capacity = capacity
        self.names = list(names)
        self.modules = list(modules)
        self.device = device
        self.groups = groups
        p = len(names)
        f32: dict[str, Any] = {"dtype": torch.float32, "device": device}
        # one table: [scalars | grad norms | tensor LRs]; a window's row is one stack into it
        self.table = torch.full((capacity, _K + p + groups), math.nan, **f32)
        self.scalars = self.table[:, :_K]
        self.grad_norm = self.table[:, _K : _K + p]
        self.lr_device = self.table[:, _K + p :]
        self.update_ratio = torch.full((capacity, p), math.nan, **f32)
        self.amax = torch.full((capacity, max(len(modules), 1)), math.nan, **f32)
        self.nan = torch.full((), math.nan, **f32)  # the piece of what a row lacks
        # host: the step in each row, its LRs, and which optional fields it holds
        self.steps: list[int | None] = [None] * capacity
        self.lr: list[list[float | None] | None] = [None] * capacity
        self.has: list[set[str]] = [set() for _ in range(capacity)]
        self._staged: dict[str, Any] | None = None  # the open window's pieces, not yet written
        self._staged_step = -1

    def row(self, step: int) -> int:
        """The row window ``step`` is (or will be) written to."""
        return step % self.capacity

    # ------------------------------------------------------------------ the fast path
    def open(self, step: int, lr: list[Any]) -> None:
        """Open window ``step``'s row: ``lr`` holds every param group's LR (floats stay on the
        host, tensors are staged for the device row). A window still staged is written first.
        Cost: host bookkeeping."""
        if self._staged is not None:
            self.commit()
        r = self.row(step)
        self.steps[r] = step
        host: list[float | None] = []
        dev: list[torch.Tensor] | None = None
        for i, v in enumerate(lr):
            if isinstance(v, torch.Tensor):
                if dev is None:
                    dev = [self.nan] * len(lr)
                dev[i] = v.detach().reshape(()).to(self.device, non_blocking=True)
                host.append(None)
            else:
                host.append(float(v))
        if dev is not None and len(dev) > self.groups:  # a param group added since
            self._widen(len(dev))
        self.lr[r] = host
        self.has[r] = set() if dev is None else {"lr"}
        self._staged = {"lr": dev}
        self._staged_step = step

    def _widen(self, groups: int) -> None:
        """Room for ``groups`` device LRs (the rows kept). Cost: one allocation and copy."""
        p = len(self.names)
        table = torch.full((self.capacity, _K + p + groups), math.nan, device=self.device)
        table[:, : self.table.shape[1]].copy_(self.table)
        self.table, self.groups = table, groups
        self.scalars, self.grad_norm = table[:, :_K], table[:, _K : _K + p]
        self.lr_device = table[:, _K + p :]

    def stage(self, step: int, **pieces: Any) -> None:
        """Stage window ``step``'s pieces (``detector``: the 4 tensors ``[loss, log bound,
        mean, spike]``; ``status``, ``scale``: 0-dim tensors; ``grad_norm``: one 0-dim tensor
        per parameter, None for a parameter without a gradient; ``inv``: a factor applied to
        the gradient norms). Cost: none (host references)."""
        if self._staged is None or self._staged_step != step:
            return
        self._staged.update(pieces)

    def commit(self) -> None:
        """Write the staged window into its row: one ``torch.stack`` (and one multiply when
        its gradient norms are still scaled). Cost: one or two device ops, no host sync."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        r = self.row(self._staged_step)
        nan = self.nan
        det = staged.get("detector")
        has = self.has[r]
        pieces: list[torch.Tensor] = list(det) if det is not None else [nan] * 4
        for name in ("status", "scale"):
            v = staged.get(name)
            pieces.append(nan if v is None else v)
            if v is not None:
                has.add(name)
        norms = staged.get("grad_norm")
        if norms is not None:
            pieces += [nan if v is None else v for v in norms]
            has.add("grad_norm")
        else:
            pieces += [nan] * len(self.names)
        lr = staged.get("lr")
        if lr is not None:
            pieces += lr + [nan] * (self.groups - len(lr))
        out = self.table[r] if lr is not None else self.table[r, : _K + len(self.names)]
        torch.stack(pieces, out=out)
        inv = staged.get("inv")
        if norms is not None and inv is not None:
            self.grad_norm[r].mul_(inv)

    def put_sampled(self, step: int, field: str, values: torch.Tensor) -> None:
        """Write a sampled row (``update_ratio`` [P] or ``amax`` [M]). Cost: one copy."""
        r = self.row(step)
        if self.steps[r] != step:
            return
        getattr(self, field)[r, : values.numel()].copy_(values)
        self.has[r].add(field)

    # ------------------------------------------------------------------ row-at-a-time API
    def start(self, step: int, lr: list[float]) -> torch.Tensor:
        """Open window ``step``'s row and return the device view the detector writes
        ``[loss, log bound, mean, spike]`` into (the unstaged path). Cost: host bookkeeping."""
        self.open(step, lr)
        self.commit()
        return self.scalars[self.row(step), :4]

    def put(self, step: int, field: str, value: torch.Tensor) -> None:
        """Write the 0-dim ``value`` as window ``step``'s ``field`` (``status`` or ``scale``).
        Cost: one copy kernel, no host sync."""
        r = self.row(step)
        self.scalars[r, _SCALARS.index(field)].copy_(value.detach().reshape(()))
        self.has[r].add(field)

    def put_grad_norms(self, step: int, grads: list[torch.Tensor | None], inv: Any) -> None:
        """Per-parameter gradient norms (``inv``: a factor that unscales them, or None).
        Parameters without a gradient read NaN. Cost: one multi-tensor norm and a stack."""
        norms = grad_norms(grads)
        if norms is None:
            return
        r = self.row(step)
        torch.stack([self.nan if v is None else v for v in norms], out=self.grad_norm[r])
        if inv is not None:
            self.grad_norm[r].mul_(inv)
        self.has[r].add("grad_norm")

    def put_vector(self, step: int, field: str, values: torch.Tensor) -> None:
        """Write a per-parameter (``update_ratio``) or per-module (``amax``) row. Cost: one
        copy kernel."""
        r = self.row(step)
        getattr(self, field)[r].copy_(values)
        self.has[r].add(field)

    # ------------------------------------------------------------------ reading
    def rows(self) -> list[dict[str, Any]]:
        """The recorded windows, oldest first, as host dicts: ``step``, ``lr``, ``loss``,
        ``bound`` (the loss above which it spikes), ``level`` (the running level of the loss),
        ``spike``, ``status``, ``scale``, and ``grad_norm`` / ``update_ratio`` / ``amax`` as
        lists; what was not recorded (or non-finite) is None. Cost: one host sync (a copy of the
        whole ring)."""
        self.commit()
        order = sorted((s, r) for r, s in enumerate(self.steps) if s is not None)
        if not order:
            return []
        idx = [r for _, r in order]
        host = (
            torch.cat([self.table[idx], self.update_ratio[idx], self.amax[idx]], dim=1)
            .cpu()
            .tolist()
        )
        p, k, g = len(self.names), _K, self.groups
        out = []
        for values, (step, r) in zip(host, order, strict=True):
            loss, log_bound, mean, spike, status, scale = values[:k]
            has = self.has[r]
            lr = list(self.lr[r] or [])
            if "lr" in has:
                dev = values[k + p : k + p + g]
                lr = [_num(d) if h is None else h for h, d in zip(lr, dev, strict=False)]
            tail = values[k + p + g :]
            out.append(
                {
                    "step": step,
                    "lr": lr,
                    "loss": _num(loss),
                    "bound": _num(math.exp(log_bound) if math.isfinite(log_bound) else math.inf),
                    "level": _num(math.exp(mean) if math.isfinite(mean) else math.nan),
                    "spike": _num(spike),
                    "status": _num(status) if "status" in has else None,
                    "scale": _num(scale) if "scale" in has else None,
                    "grad_norm": [_num(v) for v in values[k : k + p]]
                    if "grad_norm" in has
                    else [None] * p,
                    "update_ratio": [_num(v) for v in tail[:p]]
                    if "update_ratio" in has
                    else [None] * p,
                    "amax": [_num(v) for v in tail[p:]][: len(self.modules)]
                    if "amax" in has
                    else [None] * len(self.modules),
                }
            )
        return out

    def recorded(self, step: int) -> tuple[float, float, float] | None:
        """``(loss, bound, level)`` of window ``step`` if it is still in the ring. Cost: one host
        sync."""
        self.commit()
        r = self.row(step)
        if self.steps[r] != step:
            return None
        loss, log_bound, mean = self.scalars[r, :3].tolist()
        return loss, math.exp(log_bound), math.exp(mean)

    def memory_bytes(self) -> int:
        """Device bytes held by the ring."""
        return 4 * (self.table.numel() + self.update_ratio.numel() + self.amax.numel())


def grad_norms(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None] | None:
    """The 2-norm of each gradient (fp32 0-dim tensors; None where a gradient is None), from
    one multi-tensor norm; None when no gradient is present. Cost: one ``_foreach_norm`` (two
    for mixed dtypes), no host sync."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    if all(g.dtype == torch.float32 for g in present):
        norms = list(torch._foreach_norm(present))
    else:  # low-precision gradients: their norms in fp32
        norms = list(torch._foreach_norm(present, 2, dtype=torch.float32))
    if len(present) == len(grads):
        return norms  # type: ignore[return-value]
    it = iter(norms)
    return [None if g is None else next(it) for g in grads]


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (FSDP2), else ``t``: the ring records what this rank
    holds, without a collective."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None
