"""Sync-free per-module and per-layer signatures: integer bit-sums kept on the device.

Each is kept as the 0-dim device tensor its reduction made, combined only when read. A
signature is the sum of a tensor's bits read as integers (as the DDP audit checksums the
parameters, :func:`ampguard.distributed.param_checksum`): exact, independent of the reduction
order, and changed by any single flipped bit (by ``±2**k``). :class:`SignatureRecorder` keeps,
for each recorded step, in a ring of device tensors:

* ``forward``: each leaf module's output signature (summed when a module runs twice);
* ``backward``: the signature of the gradient of each leaf module's output;
* ``grads``: each parameter's gradient signature (the scaled gradients, before unscaling):
  its L2 norm's fp32 bit pattern, all of them in one ``_foreach_norm`` pass when the backward
  ends; deterministic on one device, it changes unless the changed element is below about
  ``2e-4`` of the norm;
* ``bad``: whether a gradient or the loss (:meth:`observe_loss`) held a NaN/inf.

A replay of the same step with the same state and batch gives the same signatures bit for bit;
:func:`first_difference` names the first module (in execution order) where a replay and the
record part ways, which is where the fault struck.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from ampguard.forensics._replay import rng_state as _rng_state

__all__ = ["SignatureRecorder", "StepSignature", "bitsum", "first_difference"]

_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bitsum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bits read as integers, modulo ``2**32`` (elements of up to 4 bytes:
    an int32 accumulator, 4x faster than int64 on the CPU; 8-byte elements: int64), as a
    0-dim tensor on its device. Still exact, independent of the order, and changed by any
    single flipped bit (by ``±2**k``, never a multiple of ``2**32``). One kernel (an integer
    view has the same strides; no detach: an integer view carries no gradient), no host sync.
    """
    size = t.element_size()
    return t.view(_INTS[size]).sum(dtype=torch.int64 if size == 8 else torch.int32)


def _wordsum(t: torch.Tensor) -> torch.Tensor:
    """:func:`bitsum` for the hooks: a contiguous 2-byte tensor (bf16/fp16 under autocast) with
    an even last dimension is summed as int32 words (two elements each: half the elements and
    no widening, 2-4x faster on the CPU). Its value differs from :func:`bitsum`'s, but it is as
    exact and order-free, and a flipped bit still changes it by ``±2**k`` (``k < 32``)."""
    if t.element_size() == 2 and t.dim() and not t.shape[-1] % 2 and t.is_contiguous():
        return t.view(torch.int32).sum(dtype=torch.int32)
    return bitsum(t)


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
    # False: the step was not recorded (sampled out); only its loss is known (``loss``, the
    # flight recorder's; None when it was NaN/inf), so a replay is compared on the loss alone
    complete: bool = True
    loss: float | None = None


class SignatureRecorder:
    """Records :class:`StepSignature` rows for ``model`` on the device, with no host sync.

    ``every``: record one step in ``every`` (1: every step). ``capacity``: how many recorded
    steps the ring keeps. ``clock``: returns the step number of the forward that is starting
    (``lambda: guard.steps``); by default the recorder counts the model's forward calls.
    Gradient-accumulation windows: the last micro-batch's signatures are kept.

    Left to itself the recorder keeps a forward pre-hook on the model, which decides on each
    forward whether the step is recorded (one Python call and a host copy of the RNG state on
    an unrecorded step, so that it can be replayed too: :func:`ampguard.triage` compares an
    unrecorded step's loss only). Driven by its owner (:meth:`window`, which the Guard and
    ``ampguard.watch`` call as each window begins), it hooks the model only on the windows it
    records, and on the others only with ``unrecorded_rng`` (for their RNG state: the Guard
    asks for it when its flight recorder keeps their losses); otherwise an unrecorded window
    runs no hook at all.

    Cost per recorded step: one integer reduction per leaf module output, one per gradient of
    such an output (a pre-hook on its autograd node, no tensor hook), plus one
    ``_foreach_norm`` over the parameters' gradients in one callback at the end of the backward
    (no per-parameter hook); a forward hook per leaf for the length of the model's forward, and
    a host copy of the RNG state. No host sync; :meth:`read` and :meth:`bad_steps` sync.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        every: int = 1,
        capacity: int = 16,
        clock: Callable[[], int] | None = None,
        unrecorded_rng: bool = True,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, value in (("every", every), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**6:
                raise ValueError(f"{name} must be an int in [1, 1000000], got {value!r}")
        self.model, self.every, self.capacity, self._clock = model, every, capacity, clock
        self.unrecorded_rng = bool(unrecorded_rng)
        self.leaves = [(n, m) for n, m in model.named_modules() if not any(m.children())]
        # each leaf's forward hook, made once (its index bound), under a hook id of its own:
        # put into the leaf's hook dict per recorded forward (what register_forward_hook does,
        # less its handle: a tenth of its cost) and taken out when the forward returns
        self._leaf_hooks: list[tuple[Any, int, Callable[..., None]]] = [
            (m._forward_hooks, _hook_id(), partial(self._output_hook, i))
            for i, (_, m) in enumerate(self.leaves)
        ]
        self._leaf_hooks.append((model._forward_hooks, _hook_id(), self._end))
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.owners = {n: n.rpartition(".")[0] for n, _ in self.params}
        self._device_type = next((p.device.type for _, p in self.params), "cpu")
        # per slot: (kind, index, device tensor) as the hooks made them; combined on read (one
        # stack, one host read), so a recorded step costs one reduction per tensor
        self._rows: list[list[tuple[int, int, Any]]] = [[] for _ in range(capacity)]
        self._steps: list[int | None] = [None] * capacity
        self._forwards = 0
        self._slot = 0
        self._orders: list[tuple[list[int], list[int]]] = [([], []) for _ in range(capacity)]
        self._hooked = False  # the leaves' forward hooks are in (a recorded forward runs)
        self._queued = True  # the gradient callback of the step being recorded
        self._rng: list[Any] = [None] * capacity
        self._recent: deque[tuple[int, Any]] = deque(maxlen=capacity)  # every step's RNG
        self._grad_index: list[list[int]] = [[] for _ in range(capacity)]
        self.paused = False
        # the ampguard.TriageEvent of each step ag.triage decided with this recorder (the
        # Guard's findings() reads them): step -> event
        self.events: dict[int, Any] = {}
        self._window: int | None = None  # the window window() announced (None: not driven)
        self._removed = False
        self._mode = 0  # the model's forward pre-hook: 0 _begin, 1 _keep_rng, 2 none
        self._root: Any = model.register_forward_pre_hook(self._begin)

    # -- recording
    def window(self, step: int) -> None:
        """Window ``step`` begins (the step number ``clock`` returns during it): from the first
        call on, the model is hooked only while a window is recorded (``step % every == 0``),
        and for the other windows only with ``unrecorded_rng`` (one pre-hook keeping their RNG
        state); else they run no hook at all. The Guard calls it as each window begins (after
        each step, and when its step counter is set). Cost: an integer compare (a hook added
        or removed when the mode changes); no host sync."""
        if self._hooked:  # a recorded forward that raised: its leaves' hooks
            self._detach()
        if self._removed:
            return
        self._window = step
        mode = 0 if not step % self.every else 1 if self.unrecorded_rng else 2
        if mode != self._mode:
            if self._root is not None:
                self._root.remove()
            hook = (self._begin, self._keep_rng, None)[mode]
            self._root = None if hook is None else self.model.register_forward_pre_hook(hook)
            self._mode = mode

    def _now(self) -> int:
        if self._clock is not None:
            return self._clock()
        return self._forwards if self._window is None else self._window

    def _keep_rng(self, _m: Any, _args: Any) -> None:
        """An unrecorded window's forward (driven by :meth:`window`): its RNG state only."""
        step = self._now()
        self._forwards += 1
        if not self.paused:
            self._recent.append((step, _rng_state(self._device_type)))

    def _begin(self, _m: Any, _args: Any) -> None:
        step = self._now()
        self._forwards += 1
        if self._hooked:  # a forward that raised: its hooks
            self._detach()
        if self.paused:
            return
        rng = _rng_state(self._device_type)  # every step's: an unrecorded one replays too
        self._recent.append((step, rng))
        if step % self.every:
            return
        self._slot = slot = (step // self.every) % self.capacity
        self._steps[slot] = step
        self._rng[slot] = rng
        self._rows[slot] = []
        self._orders[slot] = ([], [])
        self._grad_index[slot] = []
        self._queued = False
        # registered now, so they run after the module's own hooks (they see what its
        # consumers see); the model's post-hook takes them off when the forward returns
        for hooks, key, hook in self._leaf_hooks:
            hooks[key] = hook
        self._hooked = True

    def _end(self, _m: Any, _args: Any, _out: Any) -> None:
        self._detach()

    def _output_hook(self, i: int, _module: Any, _args: Any, out: Any) -> None:
        if type(out) is torch.Tensor:
            if not out.is_floating_point():
                return
            tensors = [out]
        else:
            tensors = _floats(out)
            if not tensors:
                return
        slot = self._slot
        fwd_order, bwd_order = self._orders[slot]
        fwd_order.append(i)
        row = self._rows[slot]
        for t in tensors:
            row.append((_FWD, i, _wordsum(t)))
            node = t.grad_fn
            if node is not None:
                node.register_prehook(partial(self._output_grad, row, i, bwd_order, t.output_nr))

    def _output_grad(
        self, row: list[tuple[int, int, Any]], i: int, order: list[int], nr: int, grads: Any
    ) -> None:
        g = grads[nr]
        if g is None:
            return
        order.append(i)
        row.append((_BWD, i, _wordsum(g)))
        if not self._queued:  # the parameters' gradients: once, when the backward ends
            self._queued = True
            Variable._execution_engine.queue_callback(partial(self._grads, row))

    def _grads(self, row: list[tuple[int, int, Any]]) -> None:
        """At the end of the backward: every parameter gradient's signature in one foreach
        pass (its L2 norm, compared bit for bit), which is also the NaN/inf flag. The norms
        are kept as the list the pass made (stacked on read)."""
        present = [(j, p.grad) for j, (_, p) in enumerate(self.params) if p.grad is not None]
        if present:
            with torch.no_grad():  # create_graph=True: no graph through the norms
                norms = torch._foreach_norm([g for _, g in present])
            row.append((_GRAD, -1, norms))
            self._grad_index[self._slot] = [j for j, _ in present]

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Mark the step being recorded as failed when ``loss`` is NaN/inf (the loss is computed
        outside the model, so the recorder sees it only through this call). Cost: one device
        op, no host sync."""
        if self._steps[self._slot] is not None and not self.paused:
            self._rows[self._slot].append((_SUM, -1, loss.detach().float().sum()))

    def _detach(self) -> None:
        for hooks, key, _ in self._leaf_hooks:
            hooks.pop(key, None)
        self._hooked = False

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
        for a replay that draws the same dropout masks: a recorded step's, or one of the last
        ``capacity`` steps'. ``KeyError`` otherwise. Cost: no host sync."""
        if step in self._steps:
            return self._rng[self._steps.index(step)]
        for s, state in reversed(self._recent):
            if s == step:
                return state
        raise KeyError(f"step {step}'s RNG state is not kept (neither recorded nor recent)")

    def _slot_of(self, step: int) -> int:
        if step not in self._steps:
            raise KeyError(f"step {step} is not recorded (the ring holds {self.steps})")
        return self._steps.index(step)

    def bad_steps(self) -> list[int]:
        """Recorded steps whose gradients or loss (:meth:`observe_loss`) held NaN/inf.
        Cost: one host sync."""
        flags = [
            (s, _vector(t))
            for s, row in zip(self._steps, self._rows, strict=True)
            if s is not None
            for kind, _, t in row
            if kind in (_SUM, _GRAD)
        ]
        if not flags:
            return []
        device = flags[0][1].device
        finite = [torch.isfinite(t.to(device)).all() for _, t in flags]
        ok = torch.stack(finite).tolist()
        return sorted({s for (s, _), fine in zip(flags, ok, strict=True) if not fine})

    def _row(self, step: int, slot: int) -> StepSignature:
        row = self._rows[slot]
        ints = [t.long() for kind, _, t in row if kind in (_FWD, _BWD)]
        values = torch.stack(ints).tolist() if ints else []
        norms = [_vector(t) for kind, _, t in row if kind == _GRAD]
        floats = [_vector(t) for kind, _, t in row if kind in (_SUM, _GRAD)]
        bad = bool(floats) and not bool(torch.isfinite(torch.cat(floats)).all())
        names = [n for n, _ in self.leaves]
        tables: dict[int, dict[int, int]] = {_FWD: {}, _BWD: {}}
        it = iter(values)
        for kind, i, _ in row:
            if kind in tables:
                table = tables[kind]
                table[i] = table.get(i, 0) + next(it)
        # a gradient's signature: its norm's fp32 bit pattern (a NaN equals the same NaN)
        bits = norms[-1].contiguous().view(torch.int32).tolist() if norms else []
        grads = dict(zip(self._grad_index[slot], bits, strict=True))
        fwd_order, bwd_order = self._orders[slot]
        return StepSignature(
            step,
            {n: tables[_FWD].get(i, 0) for i, n in enumerate(names)},
            {n: tables[_BWD].get(i, 0) for i, n in enumerate(names)},
            {n: grads.get(j, 0) for j, (n, _) in enumerate(self.params)},
            bad,
            _dedup(names, fwd_order),
            _dedup(names, bwd_order),
            dict(self.owners),
        )

    def remove(self) -> None:
        """Remove every hook from the model. Idempotent."""
        self._detach()
        if self._root is not None:
            self._root.remove()
        self._root, self._mode, self._removed = None, 2, True


def _hook_id() -> int:
    """A hook id of its own (from the counter ``register_forward_hook``'s handles draw on)."""
    return RemovableHandle(OrderedDict()).id


def _vector(t: Any) -> torch.Tensor:
    """A row's loss sum or gradient norms (the list ``_foreach_norm`` made) as one 1-D fp32
    tensor (exact: a bf16/fp16 norm widens without rounding)."""
    if isinstance(t, torch.Tensor):
        return t.reshape(-1).float()
    return torch.stack([n.float() for n in t])


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
