"""Absorbed fp16 overflow on range-sampling steps: per module, the half-precision ops of the
forward that turned finite inputs into inf/NaN.

A step whose loss and gradients are finite can still have overflowed inside a module: a
hand-written norm squares ``x - u`` to inf, ``sqrt(inf)`` divides it back to 0 and the module
outputs its bias. Nothing reaches the scaler. On the windows telemetry range-samples, the
:class:`AbsorbedCounter` watches the model's forward passes with a ``TorchDispatchMode`` and,
for every op with a float16/bfloat16 output, adds ``out is non-finite and no input was`` to
its module's counter (the innermost module whose own code ran the op). All of that stays on the
device; the counters of each sampled window are stacked and copied to the host at the
telemetry flush (through its own :class:`~ampguard.telemetry._staging.HostStaging`: no sync on
CUDA), and windows where some module counted become ``{"kind": "absorbed", "step",
"modules": {name: ops}}`` events of the run log. Rule AG170 (:mod:`ampguard.rules._silent`)
reads them for the steps that applied.

Cost: nothing on the other windows (the counter's hooks are installed when a sampled window
starts and removed when it ends; telemetry checks one integer per step). On a sampled window:
two hooks per module per forward, and per half-precision op about four small device ops (the
finiteness of its output and of inputs not produced by an op seen before), no host sync.
Forward passes run with gradients disabled (an evaluation between steps) are not counted.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ampguard._util.cadence import early_or_every, early_windows
from ampguard.telemetry._staging import HostStaging

__all__ = ["AbsorbedCounter", "EVENT_KIND", "counter_for_run"]

EVENT_KIND = "absorbed"
_LOW = (torch.float16, torch.bfloat16)


class _Mode(TorchDispatchMode):
    def __init__(self, counter: AbsorbedCounter) -> None:
        super().__init__()
        self.record = counter.record

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            with _quiet():
                self.record(args, kwargs, out)
        return out


def _quiet() -> Any:
    """Our own bookkeeping ops must not reach an outer dispatch mode (the Guard's forensics
    trace of the same window): hide every mode while they run, if there is one."""
    if torch._C._len_torch_dispatch_stack():
        return _disable_current_modes()
    return contextlib.nullcontext()


class AbsorbedCounter:
    """Per-module counts of half-precision ops that made inf/NaN from finite inputs, on the
    windows telemetry range-samples (see the module docstring).

    ``arm(step)`` before window ``step``'s forward passes, ``disarm()`` once its optimizer
    step is done; ``push()`` at the telemetry flush, ``records(wait)`` for the events whose copy
    has reached the host.

    How it stays cheap: each traced tensor gets one fp32 ``sum`` (a single kernel; non-finite
    exactly when an element is inf or NaN: fp32 holds the sum of any finite fp16 tensor), kept in
    a list of slots; an op is a candidate (its output slot, its inputs' slots, its module). When a
    forward ends, one stack of the slots and a few index ops turn every candidate into
    ``out non-finite and no input non-finite`` and add it to its module's counter, all on the
    device.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, windows: int) -> None:
        self.model = model
        self.device = device
        self.modules = [name for name, _ in model.named_modules()]
        self._index = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
        self._windows = max(1, windows)  # sampled windows between two flushes, at most
        self._stage = HostStaging(self._windows * len(self.modules), device)
        self.armed_step: int | None = None
        self._row: torch.Tensor | None = None
        self._rows: list[tuple[int, torch.Tensor]] = []  # sampled windows since the last push
        self._root: list[Any] = []  # the root module's hooks while armed
        self._inner: list[Any] = []  # every module's hooks during an armed forward
        self._stack: list[int] = []
        self._mode: _Mode | None = None
        self._host: list[tuple[Any, list[int]]] = []  # copies on the host, not yet turned out
        # one forward's trace: slot sums, id(tensor) -> (ref, slot), candidate ops
        self._sums: list[torch.Tensor] = []
        self._slot: dict[int, tuple[Any, int]] = {}
        self._outs: list[int] = []  # per candidate: its output's slot
        self._mods: list[int] = []  # per candidate: its module's index
        self._pairs: tuple[list[int], list[int]] = ([], [])  # (candidate, input slot) pairs

    # ------------------------------------------------------------------ window
    def arm(self, step: int) -> None:
        """Count the forward passes of window ``step`` (1-based). Cost: one zero-filled device
        tensor of one value per module."""
        if self.armed_step is not None:
            self.disarm()
        self.armed_step = step
        self._row = torch.zeros(len(self.modules), dtype=torch.float32, device=self.device)
        self._root = [
            self.model.register_forward_pre_hook(self._enter),
            self.model.register_forward_hook(self._leave, always_call=True),
        ]

    def disarm(self) -> None:
        """Window over: keep its counters for the next push and remove every hook."""
        for h in self._root:
            h.remove()
        self._root = []
        self._leave()
        if self.armed_step is not None and self._row is not None:
            self._rows.append((self.armed_step, self._row))
        self.armed_step, self._row = None, None

    def forget(self) -> None:
        """The armed window ended without a step (an abort): drop its counters."""
        self._row = None
        self.disarm()

    # ------------------------------------------------------------------ forward
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if self._mode is not None or not torch.is_grad_enabled():
            return
        self._stack = [0]
        for m in self.model.modules():
            if m is not self.model:
                self._inner.append(m.register_forward_pre_hook(self._push))
                self._inner.append(m.register_forward_hook(self._pop, always_call=True))
        self._mode = _Mode(self)
        self._mode.__enter__()

    def _leave(self, *unused: Any) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        for h in self._inner:
            h.remove()
        self._inner, self._stack = [], []
        with _quiet():
            self._count()

    def _push(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(self._index.get(id(module), self._stack[-1]))

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if len(self._stack) > 1:
            self._stack.pop()

    def _slot_of(self, t: torch.Tensor) -> int:
        known = self._slot.get(id(t))
        if known is not None and known[0]() is t:
            return known[1]
        slot = len(self._sums)
        self._sums.append(t.sum(dtype=torch.float32))  # below autograd here: no graph
        self._slot[id(t)] = (weakref.ref(t), slot)
        return slot

    def record(self, args: Any, kwargs: Any, out: Any) -> None:
        """One op of an armed forward (called by the dispatch mode). Cost: one fp32 sum per
        half-precision output and per floating input not seen before; no host sync."""
        if type(out) is torch.Tensor:
            if out.dtype not in _LOW or not out.numel():
                return
            outs = [out]
        else:
            outs = [t for t in _tensors(out) if t.dtype in _LOW and t.numel()]
            if not outs:
                return
        slots = [self._slot_of(t) for t in outs]
        for a in args:
            if type(a) is float and not math.isfinite(a):
                return  # an intentional -inf (a mask): its output is known bad, not an overflow
        inputs = [
            self._slot_of(t)
            for t in (
                _tensors(args) + _tensors(list(kwargs.values())) if kwargs else _tensors(args)
            )
            if t.is_floating_point() and t.numel()
        ]
        module = self._stack[-1] if self._stack else 0
        for slot in slots:
            k = len(self._outs)
            self._outs.append(slot)
            self._mods.append(module)
            self._pairs[0].extend([k] * len(inputs))
            self._pairs[1].extend(inputs)

    def _count(self) -> None:
        """Turn the forward's candidates into per-module counts, on the device."""
        sums, outs, mods, (pair_op, pair_slot) = self._sums, self._outs, self._mods, self._pairs
        self._sums, self._slot, self._outs, self._mods, self._pairs = [], {}, [], [], ([], [])
        if not outs or self._row is None:
            return
        device = self.device
        bad = ~torch.isfinite(torch.stack(sums))

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        tainted = torch.zeros(len(outs), dtype=torch.float32, device=device)
        if pair_op:
            tainted.index_add_(0, ints(pair_op), bad[ints(pair_slot)].float())
        new = bad[ints(outs)] & (tainted == 0)
        self._row.index_add_(0, ints(mods), new.float())

    # ------------------------------------------------------------------ flush
    def push(self) -> None:
        """Queue the sampled windows' counters for the host (one copy; no sync on CUDA)."""
        rows, self._rows = self._rows, []
        while rows:
            part, rows = rows[: self._windows], rows[self._windows :]
            self._drain(wait=False)  # frees a host buffer (waits for the oldest if none is)
            flat = torch.stack([r for _, r in part]).reshape(-1)
            self._stage.push(flat, [s for s, _ in part])

    def _drain(self, wait: bool) -> None:
        # copied out of the staging buffer: it is reused by the next push
        self._host.extend((values.copy(), steps) for values, steps in self._stage.ready(wait))

    def records(self, wait: bool) -> list[dict[str, Any]]:
        """Run-log events of the copies on the host: one per sampled window where some module
        counted. Cost: a sync only with ``wait`` on CUDA."""
        self._drain(wait)
        done, self._host = self._host, []
        out = []
        for values, steps in done:
            n = len(self.modules)
            for k, step in enumerate(steps):
                row = values[k * n : (k + 1) * n]
                hit = {self.modules[i]: int(v) for i, v in enumerate(row.tolist()) if v > 0}
                if hit:
                    out.append({"kind": EVENT_KIND, "step": int(step), "modules": hit})
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The plain tensors of an op's arguments or outputs. Wrapper subclasses (torchao's
    Float8TrainingTensor, DTensor) are left out: they support few ops, and the ops on their
    inner plain tensors come through this mode themselves."""
    if isinstance(value, torch.Tensor):
        return [value] if _plain(value) else []
    out: list[torch.Tensor] = []
    if isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                if _plain(v):
                    out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(t for t in v if isinstance(t, torch.Tensor) and _plain(t))
    return out


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def counter_for_run(
    model: torch.nn.Module, device: torch.device, flush_every: int, range_every: int
) -> AbsorbedCounter:
    """The AG170 counter of a run: slots for a flush's range-sampled windows and for windows
    1, 2, 4, ... below ``range_every`` (a failure present from step 0 shows early), armed for
    window 1 when it is one of them. Cost: none until armed."""
    counter = AbsorbedCounter(
        model, device, flush_every // range_every + 1 + early_windows(range_every)
    )
    if early_or_every(1, range_every):
        counter.arm(1)
    return counter
