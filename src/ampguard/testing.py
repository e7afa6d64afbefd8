"""Test helpers: count the host syncs a piece of PyTorch code makes; plant hardware faults.

:func:`inject_fault` flips one bit of one element of a module's or an op's output, once or on
every call, on one rank, so a pipeline's detection and ``ag.triage`` can be tested without a
broken GPU (see docs/triage.md).

>>> t = torch.ones(3)
>>> with SyncCounter() as syncs:
...     total = t.sum().item()
>>> syncs.count
1

Works on any device, CPU included, so a test can assert "this step adds no host sync" without a
GPU. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the stricter check: it also catches
syncs that read no value into Python (``torch.cuda.synchronize``, a blocking copy, a data-dependent
shape such as ``nonzero``), which this counter does not see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "BITS",
    "PHASES",
    "FaultInjector",
    "SyncCounter",
    "bit_position",
    "count_syncs",
    "flip_bit",
    "inject_fault",
    "on_reference_device",
]


class _ScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: every ``.item()``, ``bool(t)``, ``int(t)``, ..."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _ListReads(TorchFunctionMode):
    """Counts ``Tensor.tolist``, which reads device values without reaching the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.tolist:
            self.count += 1
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Context manager counting the device-to-host reads made inside it.

    Counts two things: scalar reads (every call of ``aten._local_scalar_dense``: ``.item()``,
    ``bool(t)``, ``int(t)``, ``float(t)``, ``if t:``) and ``Tensor.tolist()`` calls (one each,
    however long the list). ``count`` is their sum, readable inside the block and after it;
    each ``with`` starts again from 0.
    Pure device ops (``add``, ``matmul``, an optimizer's foreach/fused kernels) count 0. On
    CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the stricter check: it also sees syncs
    that read no value into Python (``torch.cuda.synchronize``, blocking copies, ``nonzero``).

    Cost: none of its own; every op inside the block passes through two Python-level modes, so
    do not time code while counting it.
    """

    def __init__(self) -> None:
        self._scalars = _ScalarReads()
        self._lists = _ListReads()

    def __enter__(self) -> SyncCounter:
        self._scalars, self._lists = _ScalarReads(), _ListReads()
        self._lists.__enter__()
        self._scalars.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scalars.__exit__(*exc)
        self._lists.__exit__(*exc)

    @property
    def count(self) -> int:
        """Scalar reads plus ``tolist`` calls seen so far."""
        return self._scalars.count + self._lists.count


def count_syncs(fn: Callable[[], object], steps: int) -> float:
    """Host syncs per call of ``fn``, averaged over ``steps`` calls (see :class:`SyncCounter`).

    Cost: whatever ``fn`` costs, ``steps`` times, plus the counter's per-op overhead.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    with SyncCounter() as counter:
        for _ in range(steps):
            fn()
    return counter.count / steps


# -- the fault injector ---------------------------------------------------------------------

BITS = ("exponent_top", "exponent_low", "mantissa")
"""The bit classes :func:`inject_fault` flips: the exponent's most significant bit (a value
becomes ~2**±(max exponent): inf, huge or a subnormal), its least significant bit (the value
doubles or halves) and the mantissa's most significant bit (a relative change of up to 50%)."""

PHASES = ("forward", "backward")

_FORMATS = {  # dtype -> (integer view, mantissa bits, exponent bits)
    torch.float64: (torch.int64, 52, 11),
    torch.float32: (torch.int32, 23, 8),
    torch.float16: (torch.int16, 10, 5),
    torch.bfloat16: (torch.int16, 7, 8),
}

_REFERENCE = [0]  # > 0 inside on_reference_device()


class on_reference_device:
    """Context manager: code inside stands for a different, healthy device.

    The faults :func:`inject_fault` plants model a broken accelerator on one rank, so they do
    not fire inside this block: ampguard's triage runs its reference replay (the CPU replay
    that stands in for a peer in one process) under it. Reentrant; not thread-safe.
    """

    def __enter__(self) -> on_reference_device:
        _REFERENCE[0] += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _REFERENCE[0] -= 1


def bit_position(dtype: torch.dtype, bit: str) -> int:
    """The index (0 = least significant) of ``bit`` (one of :data:`BITS`) in ``dtype``'s bits."""
    if bit not in BITS:
        raise ValueError(f"bit must be one of {BITS}, got {bit!r}")
    if dtype not in _FORMATS:
        raise ValueError(f"cannot flip bits of a {dtype} tensor (floating dtypes only)")
    _, mantissa, exponent = _FORMATS[dtype]
    return {
        "exponent_top": mantissa + exponent - 1,
        "exponent_low": mantissa,
        "mantissa": mantissa - 1,
    }[bit]


def flip_bit(t: torch.Tensor, element: int, bit: str) -> None:
    """Flip ``bit`` of the flat ``element`` (taken modulo ``t.numel()``) of ``t`` in place,
    behind autograd's back (as corrupted memory would: saved tensors see it too)."""
    ints, pos = _FORMATS[t.dtype][0], bit_position(t.dtype, bit)
    data = t.data
    if data.numel() == 0:
        return
    index = element % data.numel()
    flat = data.view(-1) if data.is_contiguous() else None
    mask = 1 << pos  # never the sign bit, so it fits the signed integer view
    if flat is not None:
        flat[index : index + 1].view(ints).bitwise_xor_(mask)
        return
    coords = torch.unravel_index(torch.tensor(index), data.shape)
    cell = data[tuple(int(c) for c in coords)].reshape(1).clone()
    cell.view(ints).bitwise_xor_(mask)
    data[tuple(int(c) for c in coords)] = cell[0]


def _first_float(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.dtype in _FORMATS else None
    if isinstance(value, (tuple, list)):
        for v in value:
            found = _first_float(v)
            if found is not None:
                return found
    return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _OpFaults(TorchDispatchMode):
    def __init__(self, injector: FaultInjector) -> None:
        super().__init__()
        self.injector = injector

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inj = self.injector
        if inj.op_matches(func):
            phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
            if phase == inj.phase and inj.in_scope(phase):
                target = _first_float(out)
                if target is not None and inj.should_fire():
                    flip_bit(target, inj.element, inj.bit)
        return out


class FaultInjector:
    """A planted hardware fault: one bit of one element of a module's or op's output flips.

    Build it with :func:`inject_fault`; use it as a context manager (or call :meth:`remove`).
    ``fired`` counts the flips so far, ``fired_at`` the steps they struck.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        module: str | None,
        op: str | None,
        bit: str,
        phase: str,
        step: int,
        persistent: bool,
        rank: int,
        element: int,
        guard: Any,
    ) -> None:
        self.model, self.module, self.op, self.bit, self.phase = model, module, op, bit, phase
        self.step, self.persistent, self.rank, self.element = step, persistent, rank, element
        self.guard = guard
        self.fired = 0
        self.fired_at: list[int] = []
        self._forwards = 0
        self._handles: list[Any] = []
        self._scope = {"forward": 0, "backward": 0}
        self._mode: _OpFaults | None = None
        self._step_now = 0

    # -- the step clock
    def current_step(self) -> int:
        """The step the model's current (or next) forward belongs to: ``guard.steps`` with a
        Guard, else the count of the model's forward calls since the injector was armed."""
        if self.guard is not None:
            return int(self.guard.steps)
        return self._step_now

    def should_fire(self) -> bool:
        """Whether this call flips its bit (and counts it when it does)."""
        if _REFERENCE[0] or _rank() != self.rank:
            return False
        now = self.current_step()
        if now < self.step or (not self.persistent and self.fired):
            return False
        self.fired += 1
        self.fired_at.append(now)
        return True

    def op_matches(self, func: Any) -> bool:
        packet = getattr(func, "overloadpacket", None)
        name = packet._qualified_op_name.replace("::", ".") if packet is not None else str(func)
        return name == self.op or f"{name}.{func._overloadname}" == self.op

    def in_scope(self, phase: str) -> bool:
        return self.module is None or self._scope[phase] > 0

    # -- arming
    def _arm(self) -> None:
        def count(_m: Any, _args: Any) -> None:
            self._step_now = self._forwards
            self._forwards += 1

        self._handles.append(self.model.register_forward_pre_hook(count))
        target = dict(self.model.named_modules())[self.module] if self.module is not None else None
        if self.op is not None:
            if target is not None:
                self._scope_hooks(target)
            self._mode = _OpFaults(self)
        elif target is not None and self.phase == "forward":
            self._handles.append(target.register_forward_hook(self._flip_output))
        elif target is not None:
            self._handles.append(target.register_forward_pre_hook(self._note_inputs))
            self._handles.append(target.register_full_backward_hook(self._flip_grad_input))
            for p in target.parameters():
                self._handles.append(p.register_hook(self._flip_param_grad))
                break

    def _scope_hooks(self, target: torch.nn.Module) -> None:
        def enter(phase: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                self._scope[phase] += 1

            return hook

        def leave(phase: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                self._scope[phase] = max(0, self._scope[phase] - 1)

            return hook

        self._handles.append(target.register_forward_pre_hook(enter("forward")))
        self._handles.append(target.register_forward_hook(leave("forward")))
        if self.phase == "backward":
            self._handles.append(target.register_full_backward_pre_hook(enter("backward")))
            self._handles.append(target.register_full_backward_hook(leave("backward")))

    def _flip_output(self, _m: Any, _args: Any, out: Any) -> None:
        target = _first_float(out)
        if target is not None and self.should_fire():
            flip_bit(target, self.element, self.bit)

    def _note_inputs(self, _m: Any, args: Any) -> None:
        self._input_grads = any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (args or ())
        )

    def _flip_grad_input(self, _m: Any, grad_input: Any, _grad_output: Any) -> Any:
        if not self._input_grads:
            return None
        target = _first_float(grad_input)
        if target is None or not self.should_fire():
            return None
        grads = list(grad_input)
        i = next(i for i, g in enumerate(grads) if g is target)
        grads[i] = target.clone()
        flip_bit(grads[i], self.element, self.bit)
        return tuple(grads)

    def _flip_param_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if getattr(self, "_input_grads", True) or not self.should_fire():
            return None
        grad = grad.clone()
        flip_bit(grad, self.element, self.bit)
        return grad

    def remove(self) -> None:
        """Disarm: remove every hook and leave the op mode (if any). Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._mode is not None and self._entered:
            self._mode.__exit__(None, None, None)
            self._entered = False

    _entered = False

    def __enter__(self) -> FaultInjector:
        if self._mode is not None and not self._entered:
            self._mode.__enter__()
            self._entered = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def inject_fault(
    model: torch.nn.Module,
    *,
    module: str | None = None,
    op: str | None = None,
    bit: str = "exponent_top",
    phase: str = "forward",
    step: int = 0,
    persistent: bool = False,
    rank: int = 0,
    element: int = 0,
    guard: Any = None,
) -> FaultInjector:
    """Plant a hardware-like fault in ``model``: flip one bit of one output element.

    ``module`` (a name from ``model.named_modules()``) and/or ``op`` (an aten op such as
    ``"aten.addmm"``, ``"aten.mm.default"``) choose the output: with ``module`` alone, the
    module's output in ``phase="forward"``, or in ``"backward"`` the gradient its backward
    computes for its input (for its first parameter when its input needs no gradient); with
    ``op``, that op's output (inside ``module`` when both are given). ``bit`` is one of
    :data:`BITS`; ``element`` the flat index of the element (modulo its size).

    The fault strikes at ``step`` and, with ``persistent=True``, on every matching call from
    then on (a broken unit); otherwise once (a transient upset). Steps are ``guard.steps``
    with ``guard=``, else the model's forward calls since arming (the next forward is step 0).
    Only the process whose ``torch.distributed`` rank is ``rank`` (0 without a process group)
    is faulty, and nothing fires inside :class:`on_reference_device`.

    An op fault needs the injector entered (``with inject_fault(..., op=...):``, a
    ``TorchDispatchMode`` on this thread); a module fault is armed at once (hooks), and both
    are removed by leaving the block or :meth:`FaultInjector.remove`.

    >>> with inject_fault(model, module="fc1", bit="exponent_top", step=3):
    ...     train(model)

    Cost: module faults, two Python hooks per forward; op faults, one Python dispatch per op.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = dict(model.named_modules())
    if module is not None and module not in names:
        shown = ", ".join(repr(n) for n in list(names)[:8] if n)
        raise ValueError(f"module={module!r} is not a module of the model (it has {shown}, ...)")
    if module is None and op is None:
        raise ValueError("inject_fault needs module= (a module name) or op= (an aten op name)")
    if op is not None and not (isinstance(op, str) and op.startswith("aten.")):
        raise ValueError(f"op must name an aten op such as 'aten.addmm', got {op!r}")
    if bit not in BITS:
        raise ValueError(f"bit must be one of {BITS}, got {bit!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    for name, value in (("step", step), ("rank", rank), ("element", element)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    now = int(guard.steps) if guard is not None else 0
    if step < now:
        raise ValueError(f"step={step} is in the past: the guard's next step is {now}")
    injector = FaultInjector(
        model,
        module=module,
        op=op,
        bit=bit,
        phase=phase,
        step=step,
        persistent=bool(persistent),
        rank=rank,
        element=element,
        guard=guard,
    )
    injector._arm()
    return injector
