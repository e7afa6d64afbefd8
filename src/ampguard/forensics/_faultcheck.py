"""The reference check of a replayed step: which module, and which op in it, computed wrong.

A replay on the rank's device captures every leaf module's inputs, output, input gradients and
output gradients (:class:`Captures`). :func:`reference_check` re-runs each module alone on the
CPU (under :class:`ampguard.testing.on_reference_device`, at the same autocast precision) from
the device's own inputs, and compares: a module whose output, input gradient or parameter
gradient differs beyond rounding from what the same inputs give on the reference computed
wrong itself (its inputs were what the device gave it), which is what a broken unit does.
:func:`bisect_op` then re-executes that module on the device with every aten op checked
against its own re-execution on the reference, and names the first op that differs (or, for a
value corrupted after its kernel wrote it, the op that computed it, through views and copies).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ampguard.core.policy import PrecisionPolicy
from ampguard.forensics._optrace import op_name
from ampguard.testing import on_reference_device

__all__ = ["Captures", "Deviation", "bisect_op", "deviates", "floats", "reference_check"]

_RTOL = 4  # times the output dtype's eps: above a kernel's rounding (1 ulp), below a flipped bit


def deviates(device: Any, reference: Any) -> bool:
    """Whether ``device``'s floating tensors differ from ``reference``'s beyond rounding.

    An element deviates when one side is finite and the other not, or when
    ``|d - r| > 4 * eps(d.dtype) * (|r| + rms(r))``. Cost: a host sync per tensor pair.
    """
    ds, rs = floats(device), floats(reference)
    if len(ds) != len(rs):
        return True
    for d, r in zip(ds, rs, strict=True):
        if d.shape != r.shape:
            return True
        if d.dtype == r.dtype and _same_bits(d, r):
            continue  # the same bits, NaNs included: never a deviation
        eps = torch.finfo(d.dtype).eps
        d64, r64 = d.detach().cpu().double(), r.detach().cpu().double()
        fin_d, fin_r = torch.isfinite(d64), torch.isfinite(r64)
        if not torch.equal(fin_d, fin_r):
            return True
        if not fin_r.any():
            continue
        both = fin_r
        rms = r64[both].pow(2).mean().sqrt()
        tol = _RTOL * eps * (r64[both].abs() + rms)
        if bool(((d64[both] - r64[both]).abs() > tol).any()):
            return True
    return False


def _same_bits(d: torch.Tensor, r: torch.Tensor) -> bool:
    """Bit for bit equal (a NaN equals the same NaN: read as integers)."""
    a, b = d.detach().cpu(), r.detach().cpu()
    ints = _INTS.get(a.element_size())
    if ints is None:
        return torch.equal(a, b)
    return torch.equal(a.view(ints), b.view(ints))


_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def floats(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in floats(v)]
    return []


@dataclass
class _Capture:
    args: tuple[Any, ...]
    output: Any
    needs: tuple[bool, ...] = ()
    grad_input: tuple[Any, ...] | None = None
    grad_output: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class Deviation:
    """Where a module computed wrong: its phase, name and what differed."""

    phase: str
    module: str
    what: str
    capture: _Capture = field(repr=False, default_factory=lambda: _Capture((), None))
    expected: Any = field(repr=False, default=None)
    index: int | None = None  # a parameter gradient's: which of the module's trained parameters


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``tree_map(fn, value)``, with tensors, plain tuples/lists and scalars walked directly
    (a module's args and outputs almost always: pytree's generic walk costs more than a small
    layer's kernel)."""
    if isinstance(value, torch.Tensor) or value is None or type(value) in _SCALARS:
        return fn(value)
    if type(value) in (tuple, list):
        return type(value)(_map(fn, v) for v in value)
    return tree_map(fn, value)


_SCALARS = frozenset({int, float, bool, str, torch.device, torch.dtype})


def _copy(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _detach(value: Any) -> Any:
    return _map(_copy, value)


class Captures:
    """Hooks on every leaf module of ``model`` keeping what a replay fed it and got back.

    Cost: a copy of every leaf's inputs, output and gradients (one step's activations, twice).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.leaves = [(n, m) for n, m in model.named_modules() if not any(m.children())]
        self.caps: dict[str, _Capture] = {}
        self.order: list[str] = []
        self.backward_order: list[str] = []
        self._handles: list[Any] = []
        for name, m in self.leaves:
            self._handles.append(m.register_forward_hook(self._fwd(name)))
            self._handles.append(m.register_full_backward_hook(self._bwd(name)))

    def _fwd(self, name: str) -> Callable[..., None]:
        def hook(_m: Any, args: Any, out: Any) -> None:
            if name not in self.caps:  # a module called twice: its first call is checked
                self.order.append(name)
                needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                self.caps[name] = _Capture(_detach(tuple(args)), _detach(out), needs)

        return hook

    def _bwd(self, name: str) -> Callable[..., None]:
        def hook(_m: Any, grad_input: Any, grad_output: Any) -> None:
            cap = self.caps.get(name)
            if cap is not None and cap.grad_output is None:
                self.backward_order.append(name)
                cap.grad_input, cap.grad_output = _detach(grad_input), _detach(grad_output)

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _reference_run(
    module: torch.nn.Module, cap: _Capture, policy: PrecisionPolicy, backward: bool
) -> tuple[Any, list[torch.Tensor | None], list[torch.Tensor | None]]:
    # the module's own code on CPU copies of its state (torch.func.functional_call: no copy of
    # the module, whose attributes may hold a process group or a DDP reducer)
    params = {
        n: p.detach().cpu().clone().requires_grad_(p.requires_grad and backward)
        for n, p in module.named_parameters()
    }
    buffers = {n: b.detach().cpu().clone() for n, b in module.named_buffers()}
    args = _inputs(cap, torch.device("cpu"), backward)
    dtype = policy.dtype
    with on_reference_device(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        out = torch.func.functional_call(module, {**params, **buffers}, args)
    if not backward:
        return out, [], []
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    wanted = [p for p in params.values() if p.requires_grad]
    outs = [t for t in floats(out) if t.requires_grad]
    gouts = [g.cpu() if g is not None else None for g in _pad(cap.grad_output, len(outs))]
    pairs = [(o, g) for o, g in zip(outs, gouts, strict=True) if g is not None]
    if not pairs or not inputs + wanted:
        return out, [], []
    with on_reference_device():
        grads = torch.autograd.grad(
            [o for o, _ in pairs],
            inputs + wanted,
            [g for _, g in pairs],
            allow_unused=True,
        )
    return out, list(grads[: len(inputs)]), list(grads[len(inputs) :])


def _inputs(cap: _Capture, device: torch.device | None, grad: bool) -> tuple[Any, ...]:
    """The captured inputs on ``device``, needing a gradient where the replay's did."""
    needs = _pad(cap.needs, len(cap.args))
    return tuple(
        a.detach().to(device or a.device).clone().requires_grad_(bool(n) and grad)
        if isinstance(a, torch.Tensor)
        else a
        for a, n in zip(cap.args, needs, strict=True)
    )


def _pad(values: Any, n: int) -> list[Any]:
    vals = list(values or ())
    return (vals + [None] * n)[:n]


def reference_check(
    model: torch.nn.Module, captures: Captures, policy: PrecisionPolicy
) -> Deviation | None:
    """The first leaf module (forward order, then backward order) whose own computation on
    the device differs from the reference's on the same inputs; None when every module agrees.
    A training dropout is not checked (its reference draws another mask), nor the gradient of
    a weight tied between modules (GPT-2's embedding and head: it sums both uses).

    Cost: one forward and backward of every leaf module on the CPU (about one step), and a
    few host syncs per module.
    """
    modules = dict(model.named_modules())
    for name in captures.order:
        if _draws_random(modules[name]):
            continue
        cap = captures.caps[name]
        out, _, _ = _reference_run(modules[name], cap, policy, backward=False)
        if deviates(cap.output, out):
            return Deviation("forward", name, "output", cap, out)
    params_of = {
        name: [p for p in modules[name].parameters() if p.requires_grad] for name in captures.order
    }
    users = Counter(id(p) for ps in params_of.values() for p in ps)
    shared = {i for i, n in users.items() if n > 1}
    for name in captures.backward_order:
        if _draws_random(modules[name]):
            continue
        cap = captures.caps[name]
        _, gin, gparams = _reference_run(modules[name], cap, policy, backward=True)
        device_gin = [g for g in _pad(cap.grad_input, len(cap.args)) if g is not None]
        if gin and deviates(device_gin, [g for g in gin if g is not None]):
            return Deviation("backward", name, "input gradient", cap, gin)
        for i, (p, ref_g) in enumerate(zip(params_of[name], gparams, strict=False)):
            if id(p) in shared:  # a tied weight's gradient sums its other users' too
                continue
            if p.grad is not None and ref_g is not None and deviates(p.grad, ref_g):
                return Deviation("backward", name, "parameter gradient", cap, ref_g, i)
    return None


def _draws_random(module: torch.nn.Module) -> bool:
    """A training dropout: the reference would draw another mask (not a fault), so it is not
    checked; a fault there still shows in its consumer's inputs."""
    return (
        isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training and module.p > 0
    )


class _OpCheck(TorchDispatchMode):
    """Checks every op's output against the same op re-executed on the reference, and keeps
    which op computed the values each output's storage holds (:meth:`origin`)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_bad: str | None = None
        self.outputs: list[tuple[str, torch.Tensor]] = []
        self._origins: dict[tuple[str, int], tuple[str, torch.Tensor]] = {}  # -> (op, holder)

    def origin(self, t: torch.Tensor) -> str | None:
        """The op that computed the values ``t``'s storage holds: a view shares its base's
        storage, a copy (clone, cast, ``copy_``, ``_unsafe_view``) takes its source's op, an
        in-place op is the op of what it wrote. None for a tensor no op here wrote."""
        key = _storage(t)
        entry = self._origins.get(key) if key is not None else None
        return entry[0] if entry is not None else None

    def _trace(self, func: Any, name: str, args: Any, tensors: list[torch.Tensor]) -> None:
        returns = getattr(getattr(func, "_schema", None), "returns", ())
        aliases = [r.alias_info for r in returns if r.alias_info is not None]
        if aliases and not any(a.is_write for a in aliases):
            return  # a view: the values are its base's, whose storage it shares
        origin = name
        if name in _COPIES:  # copy_(dst, src): the source is the second tensor
            sources = [a for a in args if isinstance(a, torch.Tensor)]
            at = 1 if name == "aten.copy_" else 0
            origin = (self.origin(sources[at]) if len(sources) > at else None) or name
        for t in tensors:
            key = _storage(t)
            if key is not None:  # the holder keeps the storage alive: its address stays its own
                self._origins[key] = (origin, t)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = op_name(func)
        tensors = floats(out)
        if not tensors:
            return out
        self._trace(func, name, args, tensors)
        if _is_view(func):
            return out
        with on_reference_device():
            ref_args = _map(_to_cpu, args)
            ref_kwargs = tree_map(_to_cpu, kwargs) if kwargs else kwargs
            ref = func(*ref_args, **ref_kwargs)
        if self.first_bad is None and deviates(out, ref):
            self.first_bad = name
        self.outputs.extend((name, t.detach()) for t in tensors)
        return out


def _is_view(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _storage(t: torch.Tensor) -> tuple[str, int] | None:
    """``t``'s storage: its device and address (None without one: empty, meta, a subclass)."""
    try:
        ptr = int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None
    return (str(t.device), ptr) if ptr else None


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def bisect_op(
    model: torch.nn.Module, deviation: Deviation, policy: PrecisionPolicy
) -> tuple[str | None, str]:
    """Re-execute ``deviation.module`` on the device with every op checked: ``(op, how)``.

    ``how`` is ``"op output"`` when an op's own output differs from its re-execution on the
    reference from the same inputs, or ``"after the op"`` when every op computed right and the
    module's output, input gradient or parameter gradient was corrupted afterwards: named is
    the op that computed the values the corrupted tensor holds, through views, transposes and
    copies (a ``reshape``'s clone, autocast's casts, a gradient hook's clone): HF GPT-2's
    ``Conv1D`` input gradient, an ``mm`` viewed to the input's shape, names ``aten.mm``.
    Cost: one forward (and backward for a backward deviation) of the module, each op run
    twice, and host syncs per op.
    """
    module = dict(model.named_modules())[deviation.module]
    device = next((p.device for p in module.parameters()), None)
    args = _inputs(deviation.capture, device, deviation.phase == "backward")
    check = _OpCheck()
    autocast = policy.autocast
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # full backward hooks of a module given no grad input
        if deviation.phase == "forward":
            with check, autocast():
                out = module(*args)
            results: list[Any] = floats(out)
            expected: list[Any] = floats(deviation.expected)
        else:
            with autocast():
                out = module(*args)
            outs = [t for t in floats(out) if t.requires_grad]
            gouts = _pad(deviation.capture.grad_output, len(outs))
            pairs = [(o, g.to(o.device)) for o, g in zip(outs, gouts, strict=True) if g is not None]
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            params = [p for p in module.parameters() if p.requires_grad]
            with check:
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], inputs + params, [g for _, g in pairs], allow_unused=True
                )
            results, expected = _backward_results(deviation, grads, len(inputs))
    if check.first_bad is not None:
        return check.first_bad, "op output"
    both = zip(results, expected, strict=False)
    bad = next((r for r, e in both if _tensors(r, e) and deviates(r, e)), None)
    op = check.origin(bad) if bad is not None else None
    return op or _producer(check.outputs, deviation.expected), "after the op"


def _backward_results(
    deviation: Deviation, grads: tuple[Any, ...], n_inputs: int
) -> tuple[list[Any], list[Any]]:
    """The re-executed gradients and the reference's, position by position: the inputs'
    (the reference's ``expected`` is one per input needing a gradient), or the one parameter's
    gradient that deviated."""
    if deviation.what == "input gradient":
        return list(grads[:n_inputs]), _pad(deviation.expected, n_inputs)
    index = deviation.index
    if index is None or n_inputs + index >= len(grads):
        return [], []
    return [grads[n_inputs + index]], [deviation.expected]


def _tensors(*values: Any) -> bool:
    return all(isinstance(v, torch.Tensor) for v in values)


def _producer(outputs: list[tuple[str, torch.Tensor]], expected: Any) -> str | None:
    """For a corrupted tensor no op here wrote: the last op whose output holds its right value
    (a cast or copy of it names the op before)."""
    wanted = floats(expected)
    found = None
    for name, t in reversed(outputs):
        if any(t.shape == w.shape and not deviates(t, w) for w in wanted):
            if name not in _COPIES:
                return name
            found = found or name
    return found or (outputs[-1][0] if outputs else None)


_COPIES = frozenset(
    {"aten._to_copy", "aten.clone", "aten.copy_", "aten.contiguous", "aten._unsafe_view"}
)
