"""Op-level tracer shared by ``locate`` and ``coverage``: every aten op and the module that ran it.

A :class:`OpTrace` is a ``TorchDispatchMode`` plus forward pre/post hooks on every module of the
model. In forward an op belongs to the innermost module whose *own* code is running (the top of
the hook stack). In backward an op belongs to the module whose forward created the autograd node
that runs it: the hooks log ``(autograd sequence number, module)`` transitions, and a node's
sequence number says which module was running when it was created. Two refinements make the
backward attribution name the tensor whose gradient it is:

- a dtype cast node (``ToCopyBackward0``) is attributed to the module that produced the cast's
  input: a gradient that overflows while being cast down to an fp16 activation is that
  activation's gradient;
- a node created outside the model (in ``loss_fn``) is attributed the same way, to the module
  whose output the gradient flows into.

With ``numerics=True`` each op also records, on the device, the max |x| of its floating inputs
and of its outputs (one ``aminmax`` per tensor; NaN/inf propagate into it); :meth:`OpTrace.stats`
reads them all with one sync (each op's numbers are one small ``stack``, no host sync). The
first op of a pass that turns finite inputs into NaN/inf is hunted in batches: the candidate
ops (``hunt="low"``: fp16/bf16 outputs only) are kept with their arguments, and their numbers
are read once per :data:`HUNT_BATCH` candidates and at the end of the pass (one sync each,
instead of one per op). The first candidate that made a new non-finite value gets its NaN/inf
counts and largest finite |x| (if its outputs were not changed in place since), and, if its
output is in low precision, is recomputed from fp32 copies of its inputs (if they were not
changed in place since): ``shadow[index]`` is the max |x| it reaches in fp32 (the value that
did not fit), or None if it cannot be rerun.

Hooks and the mode are installed only inside ``with trace.session(phase):`` and removed on exit.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampguard._util.tensors import device_type as _device_type

__all__ = [
    "OpEvent",
    "OpTrace",
    "STAT_FIELDS",
    "HUNT_BATCH",
    "flatten_tensors",
    "op_name",
    "is_new",
    "LOW",
]

HUNT_BATCH = 64  # candidate ops per read of their numbers while hunting (one host sync each)

# Columns of OpTrace.stats(); -1 means "no floating tensor there" or "not measured" (the last
# three are measured only for the first op of a pass that made a non-finite value).
STAT_FIELDS = ("in_amax", "out_amax", "out_finite_amax", "out_nan", "out_inf")

LOW = (torch.float16, torch.bfloat16)

# Uninitialised memory may hold anything: never blame these ops for a non-finite value.
_UNINITIALISED = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided")


class _Candidate(NamedTuple):
    """An op that may be the first to make a non-finite value, kept until its numbers are read."""

    row: int
    event: int  # its event index
    func: Any
    args: Any
    kwargs: Any
    name: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    versions: tuple[int, ...]  # ``_version`` of its floating inputs, then of its outputs
    intentional: bool
    low: bool


class OpEvent(NamedTuple):
    """One aten op as it ran.

    ``module`` is the qualified module name (``""`` is the root) or ``None`` outside the model;
    ``dtype`` the precision the op computed in (its first floating input, else its output);
    ``numel`` the element count of its largest floating input; ``intentional`` is True when a
    non-finite Python scalar was an argument (``masked_fill(mask, -inf)``); ``row`` indexes
    :meth:`OpTrace.stats` (``None`` when numerics were not recorded for it).
    """

    index: int  # type: ignore[assignment]  # shadows tuple.index on purpose: the field name
    phase: str
    module: str | None
    op: str
    dtype: torch.dtype | None
    out_dtype: torch.dtype | None
    shape: tuple[int, ...]
    numel: int
    intentional: bool
    row: int | None
    source: str | None = None  # ``file:line`` of the user's code, for forward ops outside the model


def user_line() -> str | None:
    """``file:line`` of the innermost frame outside torch and ampguard (the user's code that
    ran the op), or None. Cost: a walk up the Python stack."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in _LIBRARY_PATHS):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


_LIBRARY_PATHS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    "<frozen ",
)


_NAMES: dict[Any, str] = {}


def op_name(func: Any) -> str:
    """``aten.addmm.default`` -> ``"aten.addmm"`` (the overload packet's name)."""
    name = _NAMES.get(func)
    if name is None:
        packet = getattr(func, "overloadpacket", None)
        name = packet._qualified_op_name.replace("::", ".") if packet is not None else str(func)
        _NAMES[func] = name
    return name


def flatten_tensors(value: Any) -> list[torch.Tensor]:
    """All tensors in nested tuples/lists/dicts (and dataclass-like ``__dict__``-free values)."""
    out: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return out


def is_new(row: list[float] | None, intentional: bool = False) -> bool:
    """The op made a non-finite value its inputs did not have (a NaN out of infs counts).

    Reads only the max |x| columns: NaN there means a NaN, inf means an inf and no NaN.
    """
    if row is None or intentional or row[1] == -1.0:
        return False
    in_amax, out_amax = row[0], row[1]
    if math.isnan(out_amax):
        return not math.isnan(in_amax)
    return math.isinf(out_amax) and math.isfinite(in_amax)


def _floating(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point() and t.numel() > 0]


def _scan_args(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], bool]:
    """Non-empty floating tensors among an aten op's arguments (tensor lists included), and
    whether a non-finite float scalar is one of them. Aten arguments nest one level at most."""
    tensors: list[torch.Tensor] = []
    nonfinite = False
    for item in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(item, torch.Tensor):
            if item.is_floating_point() and item.numel():
                tensors.append(item)
        elif isinstance(item, float):
            nonfinite = nonfinite or not math.isfinite(item)
        elif isinstance(item, (list, tuple)) and item and not isinstance(item[0], int):
            for sub in item:
                if isinstance(sub, torch.Tensor):
                    if sub.is_floating_point() and sub.numel():
                        tensors.append(sub)
                elif isinstance(sub, float):
                    nonfinite = nonfinite or not math.isfinite(sub)
    return tensors, nonfinite


class _Mode(TorchDispatchMode):
    """The dispatch half of :class:`OpTrace`; records every non-view op."""

    def __init__(self, trace: OpTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "is_view", False):
            return func(*args, **kwargs)
        trace = self.trace
        inputs, intentional = _scan_args(args, kwargs)
        in_amax = trace._input_extremes(inputs) if trace.numerics else None
        out = func(*args, **kwargs)
        trace._record(func, args, kwargs, inputs, in_amax, out, intentional)
        return out


class OpTrace:
    """Records the aten ops of a model's forward and backward with module attribution.

    >>> trace = OpTrace(model, numerics=True)
    >>> with trace.session("forward"), torch.autocast("cpu", dtype=torch.float16):
    ...     loss = loss_fn(model, batch)
    >>> with trace.session("backward"):
    ...     loss.backward()
    >>> trace.events[0].module, trace.events[0].op   # the autocast cast of the first input
    ('body', 'aten._to_copy')
    """

    def __init__(
        self, model: torch.nn.Module, *, numerics: bool = False, hunt: str = "low"
    ) -> None:
        if hunt not in ("low", "all"):
            raise ValueError(f"hunt must be 'low' or 'all', got {hunt!r}")
        self.model = model
        self.numerics = numerics
        self.hunt = hunt
        self._detail: dict[int, list[float]] = {}
        # id(tensor) -> (weakref, max |x|) of traced outputs: their consumers need no new pass
        self._known: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.events: list[OpEvent] = []
        self._rows: list[torch.Tensor] = []  # per row: the op's (min, max) values, fp32
        self._shapes: list[tuple[int, int]] = []  # per row: (input values, output values)
        self._candidates: list[_Candidate] = []
        self._names = {id(m): name for name, m in model.named_modules()}
        self._owners = {id(p): name.rpartition(".")[0] for name, p in model.named_parameters()}
        self._stack: list[str] = []
        # module -> was autocast on at every entry into its forward
        self.autocast_on_entry: dict[str, bool] = {}
        # (first autograd sequence number, module) transitions, in creation order
        self._seq: list[int] = []
        self._seq_module: list[str | None] = []
        self.phase = "forward"
        self._device_type = _device_type(model)
        self.shadow: dict[int, float | None] = {}
        self._hunting = {"forward": True, "backward": True}

    # ------------------------------------------------------------------ sessions
    @contextlib.contextmanager
    def session(self, phase: str) -> Iterator[OpTrace]:
        """Record ops of ``phase`` ("forward" | "backward") inside the block; hooks are removed
        and the mode exited on the way out, even on error."""
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}")
        self.phase = phase
        handles = self._install_hooks()
        try:
            with _Mode(self):
                yield self
        finally:
            for h in handles:
                h.remove()
            self._stack.clear()
            self._hunt()  # the pass's last candidates

    def _install_hooks(self) -> list[Any]:
        handles = []
        for module in self.model.modules():
            handles.append(module.register_forward_pre_hook(self._pre_hook, prepend=True))
            handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        return handles

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is None:
            return
        self._stack.append(name)
        enabled = torch.is_autocast_enabled(self._device_type)
        self.autocast_on_entry[name] = self.autocast_on_entry.get(name, True) and enabled
        self._mark(name)

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._names.get(id(module)) is None or not self._stack:
            return
        self._stack.pop()
        self._mark(self._stack[-1] if self._stack else None)

    def _mark(self, module: str | None) -> None:
        seq = torch._C._autograd._get_sequence_nr()
        if self._seq and self._seq[-1] == seq:
            self._seq_module[-1] = module
        else:
            self._seq.append(seq)
            self._seq_module.append(module)

    # ------------------------------------------------------------------ attribution
    def current_module(self) -> str | None:
        """The module an op running now belongs to (see the module docstring)."""
        if self.phase == "forward" or self._stack:
            return self._stack[-1] if self._stack else None
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        own = self._node_module(node)
        if own is None or node.name() == "ToCopyBackward0":
            producer = self._producer_module(node)
            return own if producer is None else producer
        return own

    def _node_module(self, node: Any) -> str | None:
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: the parameter's owner
            return self._owners.get(id(variable))
        seq = node._sequence_nr()
        i = bisect.bisect_right(self._seq, seq) - 1
        return self._seq_module[i] if i >= 0 else None

    def _producer_module(self, node: Any, depth: int = 8) -> str | None:
        frontier = [node]
        for _ in range(depth):
            nxt = []
            for n in frontier:
                for child, _slot in n.next_functions:
                    if child is None:
                        continue
                    found = self._node_module(child)
                    if found is not None:
                        return found
                    nxt.append(child)
            if not nxt:
                return None
            frontier = nxt
        return None

    # ------------------------------------------------------------------ recording
    def _record(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        inputs: list[torch.Tensor],
        ins: list[torch.Tensor] | None,
        out: Any,
        nonfinite_scalar: bool,
    ) -> None:
        outputs = (
            _floating([out]) if isinstance(out, torch.Tensor) else _floating(flatten_tensors(out))
        )
        name = op_name(func)
        module = self.current_module()
        row = None
        if self.numerics and (inputs or outputs):
            row = len(self._rows)
            self._rows.append(self._row(ins or [], outputs))
        first_out = outputs[0] if outputs else None
        dtype = inputs[0].dtype if inputs else (first_out.dtype if first_out is not None else None)
        intentional = nonfinite_scalar or name.startswith(_UNINITIALISED)
        if (
            row is not None
            and first_out is not None
            and self._hunting[self.phase]
            and (self.hunt == "all" or first_out.dtype in LOW)
        ):
            self._candidates.append(
                _Candidate(
                    row,
                    len(self.events),
                    func,
                    args,
                    kwargs,
                    name,
                    inputs,
                    outputs,
                    tuple(t._version for t in (*inputs, *outputs)),
                    intentional,
                    first_out.dtype in LOW,
                )
            )
            if len(self._candidates) >= HUNT_BATCH:
                self._hunt()
        self.events.append(
            OpEvent(
                index=len(self.events),
                phase=self.phase,
                module=module,
                op=name,
                dtype=dtype,
                out_dtype=first_out.dtype if first_out is not None else None,
                shape=tuple(first_out.shape) if first_out is not None else (),
                numel=max((t.numel() for t in inputs), default=0),
                intentional=intentional,
                row=row,
                source=user_line() if module is None and self.phase == "forward" else None,
            )
        )

    # Numerics keep each tensor's (min, max) as device scalars from one aminmax; max |x| and
    # NaN are worked out on the host when the numbers are read (fewest kernels per op).
    def _input_extremes(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """(min, max) scalars of every input; outputs of traced ops are looked up, not measured."""
        out: list[torch.Tensor] = []
        for t in inputs:
            known = self._known.get(id(t))
            if known is not None and known[0]() is t:
                out += known[1:]
            else:
                out += _aminmax(t)
        return out

    def _row(self, ins: list[torch.Tensor], outputs: list[torch.Tensor]) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for t in outputs:
            lo, hi = _aminmax(t)
            self._known[id(t)] = (weakref.ref(t), lo, hi)
            outs += (lo, hi)
        self._shapes.append((len(ins), len(outs)))
        parts = ins + outs
        device = parts[0].device
        # one small stack per op (cheaper on the CPU than a stack into a preallocated slice)
        return torch.stack([p if p.device == device else p.to(device) for p in parts]).float()

    def _values(self, rows: list[int]) -> list[list[float]]:
        """The raw (min, max) values of ``rows``. Cost: one host sync."""
        if not rows:
            return []
        device = self._rows[rows[0]].device
        flat = torch.cat([self._rows[r].to(device) for r in rows]).tolist()
        out, at = [], 0
        for row in rows:
            k = sum(self._shapes[row])
            out.append(flat[at : at + k])
            at += k
        return out

    def _hunt(self) -> None:
        """Read the waiting candidates' numbers (one sync); the first that made a new
        non-finite value gets its detail and fp32 rerun, and ends the hunt of its pass."""
        candidates, self._candidates = self._candidates, []
        if not candidates or not self._hunting[self.phase]:
            return
        for c, raw in zip(candidates, self._values([c.row for c in candidates]), strict=True):
            values = self._amaxes(raw, *self._shapes[c.row])
            if not is_new(values, c.intentional):
                continue
            self._hunting[self.phase] = False
            # a later op may have changed its inputs or outputs in place since: then what it
            # saw cannot be measured or rerun any more ("not measured", no shadow)
            now = tuple(t._version for t in (*c.inputs, *c.outputs))
            n = len(c.inputs)
            unchanged_in, unchanged_out = now[:n] == c.versions[:n], now[n:] == c.versions[n:]
            # the rerun must compute in fp32: at the end of a pass autocast may still be on
            with torch.autocast(self._device_type, enabled=False):
                self._detail[c.row] = _detail(c.outputs) if unchanged_out else [-1.0] * 3
                if c.low:
                    self.shadow[c.event] = (
                        _shadow(c.func, c.args, c.kwargs, c.name, values[0])
                        if unchanged_in
                        else None
                    )
            return

    @staticmethod
    def _amaxes(values: list[float], n_in: int, n_out: int) -> list[float]:
        """[max |x| of the inputs, of the outputs] (-1 for none, NaN if any NaN)."""
        return [_absmax(values[:n_in]), _absmax(values[n_in : n_in + n_out])]

    def stats(self) -> list[list[float]]:
        """Per-row numerics (columns :data:`STAT_FIELDS`). Cost: one host sync."""
        self._hunt()
        if not self._rows:
            return []
        out = []
        for i, (raw, (n_in, n_out)) in enumerate(
            zip(self._values(list(range(len(self._rows)))), self._shapes, strict=True)
        ):
            out.append(self._amaxes(raw, n_in, n_out) + self._detail.get(i, [-1.0, -1.0, -1.0]))
        return out


def _absmax(values: list[float]) -> float:
    if not values:
        return -1.0
    best = 0.0
    for v in values:
        if v != v:  # NaN
            return math.nan
        best = max(best, abs(v))
    return best


def _detail(outputs: list[torch.Tensor]) -> list[float]:
    """[largest finite |x|, NaN count, inf count] over ``outputs``. Cost: one host sync."""
    finite, nan, inf = [], [], []
    for t in outputs:
        a = t.detach().abs().float()
        ok = torch.isfinite(a)
        finite.append(torch.where(ok, a, torch.zeros_like(a)).amax())
        nan.append(torch.isnan(a).sum().float())
        inf.append(torch.isinf(a).sum().float())
    device = outputs[0].device
    vals = torch.stack(
        [
            torch.stack([v.to(device) for v in col]).amax()
            if i == 0
            else torch.stack([v.to(device) for v in col]).sum()
            for i, col in enumerate((finite, nan, inf))
        ]
    )
    return vals.tolist()


def _shadow(func: Any, args: Any, kwargs: Any, name: str, in_amax: float) -> float | None:
    """Max |x| of ``func``'s outputs recomputed from fp32 copies of its inputs."""
    if name == "aten._to_copy":
        return in_amax  # a cast down: the value that did not fit is its input
    if name.endswith("_") or "out" in kwargs:
        return None  # in place: the inputs are already overwritten
    try:
        with torch.no_grad():
            out = func(*_upcast(args), **_upcast(kwargs))
        values = [t.abs().amax().float() for t in _floating(flatten_tensors(out))]
        return float(torch.stack(values).amax()) if values else None
    except Exception:  # noqa: BLE001 - any op may refuse fp32 inputs; the shadow is optional
        return None


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().float() if value.dtype in LOW else value
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(v) for v in value)
    if isinstance(value, dict):
        return {k: _upcast(v) for k, v in value.items()}
    return value


def _aminmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of ``t``; fp8 tensors (torchao's casts: raw fp8 has no aminmax kernel on the
    CPU, its training tensor none at all) are read in their original precision or float32.
    No host sync."""
    t = t.detach()
    original = getattr(t, "to_original_precision", None)  # torchao's Float8TrainingTensor
    if callable(original):
        t = original()
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        t = t.float()
    lo, hi = t.aminmax()
    return lo, hi


def op_info(
    e: OpEvent,
    row: list[float],
    shadow: float | None,
    *,
    scale: float,
    precision: str,
    limit: float,
    source: str,
) -> dict[str, Any]:
    """The evidence of one traced op for a diagnosis: dtype, shape, NaN/inf counts, the scale,
    the precision's largest value, the input magnitude and the op's fp32 rerun (``shadow``)."""
    return {
        "dtype": str(e.out_dtype).replace("torch.", ""),
        "shape": list(e.shape),
        "nan_count": int(row[3]) if row[3] >= 0 else None,
        "inf_count": int(row[4]) if row[4] >= 0 else None,
        "scale": scale,
        "limit": limit,
        f"input_max_abs_{precision}": row[0],
        "max_abs_fp32": shadow,
        "source": source,
    }
