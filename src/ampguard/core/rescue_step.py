"""One optimizer step of the rescued parameters on fp32 copies, vectorised per dtype and device.

The covered parameters of one optimizer that share a dtype and a device form a
:class:`GroupPlan` (rebuilt when the methods change), laid out Kahan members first, then
stochastic, then nearest ones, each in the parameters' order; the Kahan members' buffers are
views of one flat int16 tensor in that order (2 bytes per element). A :class:`GroupStep` is one
step of a plan:

- swapping in, the fp32 values are views of one flat buffer: one ``torch._foreach_copy_`` from
  the weights and one integer add of the flat Kahan buffer (the fp32 value the weight and its
  buffer hold, :func:`~ampguard.core.rounding.kahan_read`); gradients and low-precision states
  get fp32 copies (one ``_foreach_copy_`` each); the optimizer's own step then runs on them
  unchanged (its decoupled weight decay too: applied in fp32);
- writing back is a few operations on the whole group, however many parameters it has: the
  Kahan stretch of the flat buffer is split into its rounding and the buffer
  (:func:`~ampguard.core.rounding.kahan_split_`: two integer ops for bf16, no random draw), the
  stochastic stretch is rounded stochastically (:func:`~ampguard.core.rounding.
  stochastic_round_`: one random draw, only when the group has stochastic members), one
  ``_foreach_copy_`` stores every member's weight (the nearest ones rounded there), one the fp32
  states back.

Per element this is :func:`~ampguard.core.rounding.kahan_write` /
:func:`~ampguard.core.rounding.stochastic_round` of each parameter in turn with one generator,
the stochastic members' draws taken in the layout's order; a test holds the two bitwise equal.
What remains per parameter is bookkeeping (``.data`` / ``.grad`` swapped, state entries
reassigned) and one copy in and out of each tensor. Parameters outside the plans are never
looked at. Cost: the fp32 copies (freed after the step) and a few elementwise passes over the
group; no host sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ampguard.core.rounding import kahan_split_, stochastic_round_
from ampguard.core.stagnation import LOW_PRECISION

__all__ = ["GroupPlan", "GroupStep", "plan_groups", "float_state"]

_unflatten = torch._utils._unflatten_dense_tensors  # views of one flat buffer, made in C++
_ORDER = {"kahan": 0, "stochastic": 1, "nearest": 2}


def _fp32_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 copies of ``tensors`` (same shapes and strides): one allocation each and one
    ``_foreach_copy_``."""
    out = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
    if out:
        torch._foreach_copy_(out, tensors)
    return out


def float_state(v: Any) -> bool:
    """True for an optimizer state tensor that follows its parameter (floating, not 0-dim)."""
    return isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0


class GroupPlan:
    """Covered parameters of one dtype and device as ``(index, param, method)``, in the
    layout's order; the Kahan members' buffers (``comps[i]``, replaced by views) move into one
    flat tensor, :attr:`comp_flat`."""

    def __init__(self, members: list[tuple[int, Any, str]], comps: dict[int, torch.Tensor]):
        self.members = sorted(members, key=lambda m: _ORDER[m[2]])  # stable: parameter order
        self.n_kahan = sum(m == "kahan" for _, _, m in members)
        self.n_sr = sum(m != "nearest" for _, _, m in members)
        self.indices = [i for i, _, _ in self.members]
        self.params = [p for _, p, _ in self.members]
        self.sizes = [p.numel() for p in self.params]
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.comps: list[torch.Tensor] = []
        self.comp_flat: torch.Tensor | None = None
        kahan = self.members[: self.n_kahan]
        if kahan:
            old = [comps[i] for i, _, _ in kahan]
            flat = torch.empty(
                sum(c.numel() for c in old), dtype=old[0].dtype, device=old[0].device
            )
            self.comps = list(_unflatten(flat, old))
            torch._foreach_copy_(self.comps, old)
            for (i, _, _), view in zip(kahan, self.comps, strict=True):
                comps[i] = view
            self.comp_flat = flat
        self.kahan_numel = sum(self.sizes[: self.n_kahan])
        self.sr_numel = sum(self.sizes[: self.n_sr])
        self.numel = sum(self.sizes)
        self.geometry = _geometry(self.params)


def _geometry(params: list[Any]) -> list[tuple[Any, tuple[int, ...], int]]:
    """``(shape, contiguous strides, offset)`` of each parameter in one flat buffer."""
    out, offset = [], 0
    for p in params:
        strides, step = [], 1
        for n in reversed(p.shape):
            strides.append(step)
            step *= max(n, 1)
        out.append((p.shape, tuple(reversed(strides)), offset))
        offset += p.numel()
    return out


def _views(flat: torch.Tensor, geometry: list[tuple[Any, tuple[int, ...], int]]) -> list:
    """The views of ``flat`` that :func:`_geometry` describes (one ``as_strided`` each)."""
    return [flat.as_strided(shape, strides, offset) for shape, strides, offset in geometry]


def plan_groups(
    opt: torch.optim.Optimizer,
    index: Mapping[int, int],
    methods: Mapping[int, str],
    comps: dict[int, torch.Tensor],
) -> list[GroupPlan]:
    """The :class:`GroupPlan` of each dtype and device among ``opt``'s covered parameters
    (``index``: ``id(param)`` to its index; ``methods``: index to method). Cost: a pass over the
    parameters and the Kahan buffers' move."""
    groups: dict[tuple[Any, Any], list[tuple[int, Any, str]]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            i = index.get(id(p))
            if i is not None and i in methods:
                groups.setdefault((p.dtype, p.device), []).append((i, p, methods[i]))
    return [GroupPlan(members, comps) for members in groups.values()]


class GroupStep:
    """One optimizer step of a :class:`GroupPlan`'s members that have a gradient (the optimizer
    skips the others: so does the rescue). ``measure``: True (every member) or the indices
    measured on this step."""

    def __init__(
        self,
        plan: GroupPlan,
        opt_state: Mapping[Any, Any],
        fp32_states: bool,
        measure: bool | set[int],
    ) -> None:
        if all(p.grad is not None for p in plan.params):
            self.n_kahan, self.n_sr = plan.n_kahan, plan.n_sr
            self.comps, self.comp_flat = plan.comps, plan.comp_flat
            self.indices, self.params, self.sizes = plan.indices, plan.params, plan.sizes
            self.kahan_numel, self.sr_numel = plan.kahan_numel, plan.sr_numel
            self.numel, geometry = plan.numel, plan.geometry
        else:
            has = [p.grad is not None for p in plan.params]
            self.n_kahan, self.n_sr = sum(has[: plan.n_kahan]), sum(has[: plan.n_sr])
            self.comps = [c for c, h in zip(plan.comps, has, strict=False) if h]
            self.comp_flat = None  # the members' buffers are not one stretch of it
            self.indices = [i for i, h in zip(plan.indices, has, strict=True) if h]
            self.params = [p for p, h in zip(plan.params, has, strict=True) if h]
            self.sizes = [n for n, h in zip(plan.sizes, has, strict=True) if h]
            self.kahan_numel = sum(self.sizes[: self.n_kahan])
            self.sr_numel = sum(self.sizes[: self.n_sr])
            self.numel, geometry = sum(self.sizes), _geometry(self.params)
        self.opt_state = opt_state
        self.fp32_states = fp32_states
        self.dtype = plan.dtype
        self.data = [p.data for p in self.params]  # the low-precision storage, written back
        self.grads = [p.grad for p in self.params]
        self.measured = (
            [True] * len(self.params)
            if measure is True
            else [i in measure for i in self.indices]
            if measure
            else []
        )
        self.keys: list[tuple] = []  # each member's state keys before the step
        self.slots: list[tuple[dict, Any]] = []  # (state, key) of each swapped state
        self.low: list[torch.Tensor] = []  # their low-precision tensors
        self.high: list[torch.Tensor] = []  # their fp32 copies
        self.flat = torch.empty(self.numel, dtype=torch.float32, device=plan.device)
        self.values: list[torch.Tensor] = _views(self.flat, geometry)
        self.start: torch.Tensor | None = None

    # ------------------------------------------------------------------ swap in
    def swap_in(self) -> None:
        """The fp32 values (what each weight and its buffer hold), gradients and states in
        place of the low-precision ones; on an error, everything is put back. Cost: the
        copies."""
        try:
            self._read_values()
            if any(self.measured):
                self.start = self.flat.clone()
            for p in self.params:
                state = self.opt_state.get(p)
                self.keys.append(tuple(state) if state else ())
                if state:
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and v.dtype in LOW_PRECISION and v.dim():
                            self.slots.append((state, k))
                            self.low.append(v)
            self.high = _fp32_copies(self.low)
            grads = _fp32_copies(self.grads)
        except BaseException:
            self.restore()
            raise
        for (state, k), v in zip(self.slots, self.high, strict=True):
            state[k] = v
        for p, value, grad in zip(self.params, self.values, grads, strict=True):
            p.data = value
            p.grad = grad

    def _read_values(self) -> None:
        """The flat buffer := the fp32 value of each weight (and its Kahan buffer)."""
        torch._foreach_copy_(self.values, self.data)
        if self.comp_flat is not None:
            self._stretch(self.kahan_numel).view(torch.int32).add_(self.comp_flat)
        elif self.n_kahan:
            heads = [v.view(torch.int32) for v in self.values[: self.n_kahan]]
            torch._foreach_add_(heads, self.comps)

    # ------------------------------------------------------------------ write back
    def write_back(self, generator: torch.Generator) -> list[tuple[int, torch.Tensor]]:
        """Write the stepped fp32 values back (see the module docstring), restore the
        low-precision tensors, and return ``(index, [<written, intended>, <intended,
        intended>])`` of each measured member (float64, on the device). No host sync."""
        for j, p in enumerate(self.params):  # an optimizer that replaced .data (not in place)
            if p.data_ptr() != self.values[j].data_ptr():
                self.values[j].copy_(p.data)
        intended = self.flat - self.start if self.start is not None else None
        k, sr = self.n_kahan, self.n_sr
        if self.comp_flat is not None:
            kahan_split_(self._stretch(self.kahan_numel), self.dtype, self.comp_flat)
        else:
            for value, comp in zip(self.values[:k], self.comps, strict=True):
                kahan_split_(value, self.dtype, comp)
        if sr > k:
            tail = self.flat[self.kahan_numel : self.sr_numel]
            stochastic_round_(tail if k else self._stretch(self.sr_numel), self.dtype, generator)
        torch._foreach_copy_(self.data, self.values)  # exact but for the nearest members
        sums = self._sums(intended) if intended is not None else []
        self._states_back()
        self.restore(states=False)
        return sums

    def _stretch(self, n: int) -> torch.Tensor:
        """The first ``n`` elements of the flat buffer (the buffer itself when that is all of
        it: one operation fewer)."""
        return self.flat if n == self.numel else self.flat[:n]

    def _sums(self, intended: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Per measured member: ``<written, intended>`` and ``<intended, intended>``, with
        ``written`` the change of the value the weight (and its buffer) holds, in float64."""
        assert self.start is not None
        self._read_values()  # the flat buffer now holds the value written
        written = self.flat.sub_(self.start).double()
        wanted = intended.double()
        out = []
        offset = 0
        for i, n, measured in zip(self.indices, self.sizes, self.measured, strict=True):
            if measured:
                w, x = written[offset : offset + n], wanted[offset : offset + n]
                out.append((i, torch.stack([(w * x).sum(), (x * x).sum()])))
            offset += n
        return out

    def _states_back(self) -> None:
        """Swapped states return to their dtype (they stay in fp32 with ``fp32_states``);
        states the step created (the first one) take the parameter's dtype, as the optimizer
        would have made them; fp32 states the optimizer keeps itself stay."""
        if self.fp32_states:
            return
        if self.slots:
            now = [state[k] for state, k in self.slots]
            if all(v is h for v, h in zip(now, self.high, strict=True)):  # updated in place
                torch._foreach_copy_(self.low, self.high)
                for (state, k), old in zip(self.slots, self.low, strict=True):
                    state[k] = old
            else:  # the optimizer put new tensors there
                for (state, k), old, v in zip(self.slots, self.low, now, strict=True):
                    if float_state(v) and v.dtype == torch.float32:
                        state[k] = old.copy_(v)
        for p, keys, d in zip(self.params, self.keys, self.data, strict=True):
            after = self.opt_state.get(p)
            if not after or len(after) == len(keys):
                continue
            for k, v in list(after.items()):
                if k not in keys and float_state(v) and v.dtype == torch.float32:
                    after[k] = v.to(d.dtype)

    def restore(self, states: bool = True) -> None:
        """Put the low-precision weights and gradients back (and, unless ``states`` is False,
        the swapped states: after a step that raised, the fp32 work is dropped)."""
        for p, d, g in zip(self.params, self.data, self.grads, strict=True):
            p.data = d
            p.grad = g
        if states:
            for (state, k), old in zip(self.slots, self.low, strict=True):
                state[k] = old
