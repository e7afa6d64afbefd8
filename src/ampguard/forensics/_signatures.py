"""Sync-free per-module and per-layer signatures: integer bit-sums kept on the device.

A signature is the sum of a tensor's bits read as integers (as the DDP audit checksums the
parameters, :func:`ampguard.distributed.param_checksum`): exact, independent of the reduction
order, and changed by any single flipped bit (by ``±2**k``). :class:`SignatureRecorder` keeps,
for each recorded step, in a ring of device tensors:

* ``forward``: each leaf module's output signature (summed when a module runs twice);
* ``backward``: the signature of the gradient of each leaf module's output;
* ``grads``: each parameter's gradient signature (the scaled gradients, before unscaling);
* ``bad``: whether a module output, a gradient or the loss (:meth:`observe_loss`) held a NaN/inf.

A replay of the same step with the same state and batch gives the same signatures bit for bit;
:func:`first_difference` names the first module (in execution order) where a replay and the
record part ways, which is where the fault struck.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.forensics._replay import rng_state as _rng_state

__all__ = ["SignatureRecorder", "StepSignature", "bitsum", "first_difference"]

_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bitsum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bits read as integers (0-dim int64 on its device). No host sync."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(_INTS[t.element_size()]).sum(dtype=torch.int64)


def _bad(t: torch.Tensor) -> torch.Tensor:
    return torch.logical_not(torch.isfinite(t.detach()).all())


def _floats(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _floats(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _floats(v)]
    return []


@dataclass(frozen=True)
class StepSignature:
    """One step's signatures, read to the host: names in execution order and their sums."""

    step: int
    forward: dict[str, int]
    backward: dict[str, int]
    grads: dict[str, int]
    bad: bool
    forward_order: list[str] = field(default_factory=list)
    backward_order: list[str] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)


class SignatureRecorder:
    """Records :class:`StepSignature` rows for ``model`` on the device, with no host sync.

    ``every``: record one step in ``every`` (1: every step); on the other steps no hook is
    attached. ``capacity``: how many recorded steps the ring keeps. ``clock``: returns the
    step number of the forward that is starting (``lambda: guard.steps``); by default the
    recorder counts the model's forward calls. Gradient-accumulation windows: the last
    micro-batch's signatures are kept.

    Cost per recorded step: per leaf module, two integer reductions (output and its
    gradient) and a finiteness check; per parameter, one reduction and a finiteness check;
    Python hooks around each. No host sync; :meth:`read` syncs (once).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        every: int = 1,
        capacity: int = 16,
        clock: Callable[[], int] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, value in (("every", every), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**6:
                raise ValueError(f"{name} must be an int in [1, 1000000], got {value!r}")
        self.model, self.every, self.capacity, self._clock = model, every, capacity, clock
        self.leaves = [(n, m) for n, m in model.named_modules() if not any(m.children())]
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.owners = {n: n.rpartition(".")[0] for n, _ in self.params}
        device = next((p.device for _, p in self.params), torch.device("cpu"))
        nm, np_ = len(self.leaves), len(self.params)
        self._fwd = torch.zeros(capacity, max(nm, 1), dtype=torch.int64, device=device)
        self._bwd = torch.zeros_like(self._fwd)
        self._grad = torch.zeros(capacity, max(np_, 1), dtype=torch.int64, device=device)
        self._badrow = torch.zeros(capacity, dtype=torch.bool, device=device)
        self._steps: list[int | None] = [None] * capacity
        self._forwards = 0
        self._slot = 0
        self._orders: list[tuple[list[int], list[int]]] = [([], []) for _ in range(capacity)]
        self._step_hooks: list[Any] = []
        self._rng: list[Any] = [None] * capacity
        self.paused = False
        self._root = model.register_forward_pre_hook(self._begin)

    # -- recording
    def _begin(self, _m: Any, _args: Any) -> None:
        step = self._clock() if self._clock is not None else self._forwards
        self._forwards += 1
        if self._step_hooks:  # a previous step's hooks: a step is one forward
            self._detach()
        if self.paused or step % self.every:
            return
        self._slot = slot = (step // self.every) % self.capacity
        self._steps[slot] = step
        self._rng[slot] = _rng_state(self._fwd.device.type)
        self._fwd[slot].zero_()
        self._bwd[slot].zero_()
        self._grad[slot].zero_()
        self._badrow[slot] = False
        self._orders[slot] = ([], [])
        for i, (_, m) in enumerate(self.leaves):
            self._step_hooks.append(m.register_forward_hook(self._output_hook(i)))
        for j, (_, p) in enumerate(self.params):
            self._step_hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(j)))

    def _output_hook(self, i: int) -> Callable[..., None]:
        def hook(_m: Any, _args: Any, out: Any) -> None:
            slot = self._slot
            tensors = _floats(out)
            if not tensors:
                return
            fwd_order, bwd_order = self._orders[slot]
            fwd_order.append(i)
            for t in tensors:
                self._fwd[slot, i] += bitsum(t)
                self._badrow[slot] |= _bad(t)
                if t.requires_grad:
                    t.register_hook(self._output_grad_hook(slot, i, bwd_order))

        return hook

    def _output_grad_hook(
        self, slot: int, i: int, order: list[int]
    ) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            order.append(i)
            self._bwd[slot, i] += bitsum(g)
            self._badrow[slot] |= _bad(g)

        return hook

    def _grad_hook(self, j: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                slot = self._slot
                self._grad[slot, j] = bitsum(p.grad)
                self._badrow[slot] |= _bad(p.grad)

        return hook

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Mark the step being recorded as failed when ``loss`` is NaN/inf (the loss is computed
        outside the model, so the recorder sees it only through this call; ``Guard.backward``
        makes it). Cost: one device op, no host sync."""
        if self._steps[self._slot] is not None and not self.paused:
            self._badrow[self._slot] |= _bad(loss)

    def _detach(self) -> None:
        for h in self._step_hooks:
            h.remove()
        self._step_hooks = []

    # -- reading
    @property
    def steps(self) -> list[int]:
        """The recorded steps still in the ring, oldest first. Cost: no host sync."""
        return sorted(s for s in self._steps if s is not None)

    def read(self, step: int) -> StepSignature:
        """The recorded signatures of ``step``. ``KeyError`` when it is not in the ring.
        Cost: four host syncs (one per table)."""
        return self._row(step, self._slot_of(step))

    def rng_state(self, step: int) -> dict[str, Any]:
        """The RNG state taken as ``step``'s forward began (``{"cpu": ..., "cuda": [...]}``),
        for a replay that draws the same dropout masks. Cost: no host sync."""
        return self._rng[self._slot_of(step)]

    def _slot_of(self, step: int) -> int:
        if step not in self._steps:
            raise KeyError(f"step {step} is not recorded (the ring holds {self.steps})")
        return self._steps.index(step)

    def bad_steps(self) -> list[int]:
        """Recorded steps whose outputs or gradients held NaN/inf. Cost: one host sync."""
        flags = self._badrow.tolist()
        return sorted(s for s, f in zip(self._steps, flags, strict=True) if s is not None and f)

    def _row(self, step: int, slot: int) -> StepSignature:
        fwd, bwd, grad = (t[slot].tolist() for t in (self._fwd, self._bwd, self._grad))
        names = [n for n, _ in self.leaves]
        fwd_order, bwd_order = self._orders[slot]
        return StepSignature(
            step,
            {n: fwd[i] for i, n in enumerate(names)},
            {n: bwd[i] for i, n in enumerate(names)},
            {n: grad[j] for j, (n, _) in enumerate(self.params)},
            bool(self._badrow[slot]),
            _dedup(names, fwd_order),
            _dedup(names, bwd_order),
            dict(self.owners),
        )

    def remove(self) -> None:
        """Remove every hook from the model. Idempotent."""
        self._detach()
        self._root.remove()


def _dedup(names: Sequence[str], order: Sequence[int]) -> list[str]:
    seen: dict[str, None] = {}
    for i in order:
        seen.setdefault(names[i], None)
    return list(seen)


def first_difference(
    recorded: StepSignature, replayed: StepSignature
) -> tuple[str, str | None, str] | None:
    """Where ``replayed`` first parts from ``recorded``: ``(phase, module, what)`` or None.

    Forward: the first leaf module, in execution order, whose output differs. Backward (all
    outputs equal), walking the backward's order: a module's output gradient is computed by
    the backward of the module that ran after it in backward order (its consumer; ``None``
    for the loss), and its parameters' gradients by its own backward. The orders are taken
    from the replay.
    """
    fwd_order = replayed.forward_order or list(replayed.forward)
    for name in fwd_order:
        if recorded.forward.get(name) != replayed.forward.get(name):
            return "forward", name, "output"
    bwd_order = replayed.backward_order or list(reversed(fwd_order))
    params_of: dict[str, list[str]] = {}
    for pname, owner in replayed.owners.items():
        params_of.setdefault(owner, []).append(pname)
    consumer: str | None = None
    for name in bwd_order:
        if recorded.backward.get(name) != replayed.backward.get(name):
            return "backward", consumer, f"gradient of {name!r}'s output"
        for pname in params_of.get(name, []):
            if recorded.grads.get(pname) != replayed.grads.get(pname):
                return "backward", name, f"gradient of {pname!r}"
        consumer = name
    for pname in replayed.grads:
        if recorded.grads.get(pname) != replayed.grads.get(pname):
            return "backward", replayed.owners.get(pname), f"gradient of {pname!r}"
    return None
