"""Sync-free per-module and per-layer signatures: integer bit-sums kept on the device.

Each is kept as the 0-dim device tensor its reduction made, combined only when read. A
signature is the sum of a tensor's bits read as integers (as the DDP audit checksums the
parameters, :func:`ampguard.distributed.param_checksum`): exact, independent of the reduction
order, and changed by any single flipped bit (by ``±2**k``). :class:`SignatureRecorder` keeps,
for each recorded step, in a ring of device tensors:

* ``forward``: each leaf module's output signature (summed when a module runs twice);
* ``backward``: the signature of the gradient of each leaf module's output;
* ``grads``: each parameter's gradient signature (the scaled gradients, before unscaling);
* ``bad``: whether a gradient or the loss (:meth:`observe_loss`) held a NaN/inf.

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


_FWD, _BWD, _GRAD, _SUM = range(4)


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

    Cost per recorded step: per leaf module, two integer reductions (its output and that
    output's gradient); per parameter, two reductions (its gradient's bits and its float sum,
    for NaN/inf); Python hooks around each, and a host copy of the RNG state. No host sync;
    :meth:`read` and :meth:`bad_steps` sync. Unrecorded steps (``every > 1``) cost one hook.
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
        self._device_type = next((p.device.type for _, p in self.params), "cpu")
        # per slot: (kind, index, 0-dim device tensor) as the hooks made them; combined on
        # read (one stack, one host read), so a recorded step costs one reduction per tensor
        self._rows: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in range(capacity)]
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
        self._rng[slot] = _rng_state(self._device_type)
        self._rows[slot] = []
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
            row = self._rows[slot]
            for t in tensors:
                row.append((_FWD, i, bitsum(t)))
                if t.requires_grad:
                    t.register_hook(self._output_grad_hook(row, i, bwd_order))

        return hook

    def _output_grad_hook(
        self, row: list[tuple[int, int, torch.Tensor]], i: int, order: list[int]
    ) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            order.append(i)
            row.append((_BWD, i, bitsum(g)))

        return hook

    def _grad_hook(self, j: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                row = self._rows[self._slot]
                row.append((_GRAD, j, bitsum(p.grad)))
                # a float sum is NaN/inf when an element is (or the sum overflows fp32)
                row.append((_SUM, j, p.grad.detach().sum(dtype=torch.float32)))

        return hook

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Mark the step being recorded as failed when ``loss`` is NaN/inf (the loss is computed
        outside the model, so the recorder sees it only through this call). Cost: one device
        op, no host sync."""
        if self._steps[self._slot] is not None and not self.paused:
            self._rows[self._slot].append((_SUM, -1, loss.detach().float().sum()))

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
        Cost: two host syncs."""
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
        """Recorded steps whose gradients or loss (:meth:`observe_loss`) held NaN/inf.
        Cost: one host sync."""
        sums = [
            (s, t)
            for s, row in zip(self._steps, self._rows, strict=True)
            if s is not None
            for kind, _, t in row
            if kind == _SUM
        ]
        if not sums:
            return []
        finite = torch.isfinite(torch.stack([t.to(sums[0][1].device) for _, t in sums])).tolist()
        return sorted({s for (s, _), ok in zip(sums, finite, strict=True) if not ok})

    def _row(self, step: int, slot: int) -> StepSignature:
        row = self._rows[slot]
        ints = [t for kind, _, t in row if kind != _SUM]
        floats = [t for kind, _, t in row if kind == _SUM]
        values = torch.stack(ints).tolist() if ints else []
        bad = bool(floats) and not bool(torch.isfinite(torch.stack(floats)).all())
        names = [n for n, _ in self.leaves]
        tables: dict[int, dict[int, int]] = {_FWD: {}, _BWD: {}, _GRAD: {}}
        it = iter(values)
        for kind, i, _ in row:
            if kind != _SUM:
                table = tables[kind]
                table[i] = table.get(i, 0) + next(it)
        fwd_order, bwd_order = self._orders[slot]
        return StepSignature(
            step,
            {n: tables[_FWD].get(i, 0) for i, n in enumerate(names)},
            {n: tables[_BWD].get(i, 0) for i, n in enumerate(names)},
            {n: tables[_GRAD].get(j, 0) for j, (n, _) in enumerate(self.params)},
            bad,
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


SignatureRecorder.__module__ = (
    "ampguard.forensics"  # its public home: repr and pickles name that path
)
