"""The model advisor looks inside modules: one fp16 autocast forward, op by op.

The fp32 range probe (:mod:`ampguard.experiments._range_probe`) sees module inputs and outputs.
Two hazards hide between them, and this probe runs the model's forward once under fp16 autocast
(the loss outside it, as a training loop computes it from ``.float()`` outputs) with every aten
op traced and attributed to the innermost module whose own code ran it:

- AG361: an fp16 op inside a module turns finite inputs into inf/NaN while the module's fp32
  output is in fp16's range (an attention's ``q @ k.T`` overflows before the ``1 / sqrt(d)``
  scale brings it back down): the module-level probe cannot see it.
- AG363: an fp16 op of the loss code (outside every module: ``torch.exp(out)`` on the model's
  fp16 output) overflows or flushes its values to zero, named with its source line
  (:mod:`ampguard.experiments._loss_probe`).
- AG362: a sigmoid's output feeds ``binary_cross_entropy`` and in fp16 at least one probability
  rounds to exactly 0 or 1 where fp32 keeps it inside (0, 1): that sample's gradient is exactly
  zero, and a confidently wrong one costs the clamped ``log(0)`` = 100 for good.

The model's parameters, buffers, gradients, RNG and training modes are restored afterwards.
Cost: one forward under ``torch.no_grad`` with a few device ops per fp16 op, one host sync for
all of them, and one fp32 rerun of the first overflowing op per module.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampguard._util.tensors import device_type as _device_type
from ampguard.experiments._loss_probe import LossOps, loss_finding
from ampguard.experiments._range_probe import FP16_MAX, ProbeResult
from ampguard.findings import Finding, make
from ampguard.forensics import flatten_tensors, op_name
from ampguard.replay import Preserved

__all__ = ["inner_findings"]

_LOW = (torch.float16, torch.bfloat16)
_MATMULS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.matmul", "aten.einsum")
# ops that hand a sigmoid's output on unchanged in value (casts, copies, reshapes)
_PASS = ("aten._to_copy", "aten.clone", "aten.view", "aten.reshape", "aten.squeeze", "aten.flatten")
_PASS_PREFIX = ("aten.squeeze", "aten.unsqueeze", "aten.view", "aten._unsafe_view", "aten.t")


class _Op:
    __slots__ = ("module", "name", "func", "args", "kwargs", "flag")

    def __init__(self, module: str, name: str, func: Any, args: Any, kwargs: Any, flag: Any):
        self.module, self.name, self.func = module, name, func
        self.args, self.kwargs, self.flag = args, kwargs, flag


class _Mode(TorchDispatchMode):
    def __init__(self, probe: _InnerProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.probe.record(func, args, kwargs, out)
        return out


class _InnerProbe:
    """Records, per fp16 op, whether it made a new non-finite value, and the sigmoid -> BCE
    links (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.ops: list[_Op] = []
        self.known: dict[int, tuple[Any, torch.Tensor]] = {}  # id(out) -> (ref, non-finite)
        self.sigmoids: dict[int, tuple[Any, torch.Tensor, torch.Tensor, str]] = {}
        self.bce: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]] = []
        self.loss = LossOps()

    def push(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)

    def pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.names.get(id(module)) is not None and self.stack:
            self.stack.pop()

    def record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        name = op_name(func)
        outs = [t for t in flatten_tensors(out) if t.is_floating_point() and t.numel()]
        if not outs:
            return
        self._link(name, args, outs[0])
        if outs[0].dtype not in _LOW:
            return
        bad_in = []
        for t in flatten_tensors(list(args) + list(kwargs.values())):
            if not t.is_floating_point() or not t.numel():
                continue
            known = self.known.get(id(t))
            bad_in.append(
                known[1] if known is not None and known[0]() is t else ~torch.isfinite(t).all()
            )
        bad = ~torch.stack([torch.isfinite(t).all() for t in outs]).all()
        for t in outs:
            self.known[id(t)] = (weakref.ref(t), bad)
        if any(isinstance(a, float) and not math.isfinite(a) for a in args):
            return  # an intentional -inf (a mask): not an overflow
        new = bad & ~torch.stack(bad_in).any() if bad_in else bad
        if self.stack:
            self.ops.append(_Op(self.stack[-1], name, func, args, kwargs, new))
        else:  # the loss code, outside every module: the user's line that ran it
            self.loss.record(name, func, args, kwargs, outs[0], new)

    def _link(self, name: str, args: Any, out: torch.Tensor) -> None:
        """Follow sigmoid outputs through casts and reshapes into binary_cross_entropy."""
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if name == "aten.sigmoid" and first is not None:
            self.sigmoids[id(out)] = (weakref.ref(out), out, first, self._where())
            return
        if first is None:
            return
        origin = self.sigmoids.get(id(first))
        if origin is None or origin[0]() is not first:
            return
        if name == "aten.binary_cross_entropy" and len(args) > 1:
            self.bce.append((origin[1], origin[2], args[1], origin[3]))
        elif name in _PASS or name.startswith(_PASS_PREFIX):
            if out.numel() == first.numel():
                self.sigmoids[id(out)] = (weakref.ref(out), origin[1], origin[2], origin[3])

    def _where(self) -> str:
        return self.stack[-1] if self.stack else "(loss_fn)"


def _run(model: nn.Module, batch: Any, loss_fn: Callable | None) -> _InnerProbe | None:
    device = _device_type(model)
    probe = _InnerProbe(model)
    auto = torch.autocast(device, dtype=torch.float16)
    inside = [False]  # the model's forward runs under fp16 autocast; the loss outside it

    def enter(module: nn.Module, args: Any) -> None:
        auto.__enter__()
        inside[0] = True

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if inside[0]:
            inside[0] = False
            auto.__exit__(None, None, None)

    handles = [
        model.register_forward_pre_hook(enter, prepend=True),
        model.register_forward_hook(leave, always_call=True),
    ]
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(probe.push))
        handles.append(m.register_forward_hook(probe.pop, always_call=True))
    keep = Preserved(model)
    try:
        keep.reset()
        with torch.no_grad(), _Mode(probe):
            try:
                loss_fn(model, batch) if loss_fn is not None else model(batch)
            except Exception:  # noqa: BLE001 - fp16 may break the loss; what ran is evidence
                leave(model, (), None)
    except Exception:  # noqa: BLE001 - the probe is advice: never fail inspect_model on it
        return None
    finally:
        for h in handles:
            h.remove()
        keep.close()
    return probe


def inner_findings(
    model: nn.Module, batch: Any, loss_fn: Callable | None, fp32: ProbeResult
) -> list[Finding]:
    """AG361 and AG362 from one fp16 autocast forward (see the module docstring).

    ``fp32`` is the advisor's fp32 range probe of the same batch (module outputs in range);
    when fp32 itself is non-finite (AG332) there is nothing to say about fp16 and nothing runs.
    Cost: see the module docstring.
    """
    broken = fp32.loss is not None and not math.isfinite(fp32.loss)
    if broken or any(r.out_nonfinite or r.grad_nonfinite for r in fp32.ordered()):
        return []
    probe = _run(model, batch, loss_fn)
    if probe is None:
        return []
    found = (_inside(probe, fp32), _bce(probe), loss_finding(probe.loss))
    return [f for f in found if f is not None]


def _inside(probe: _InnerProbe, fp32: ProbeResult) -> Finding | None:
    if not probe.ops:
        return None
    flags = torch.stack([op.flag for op in probe.ops]).tolist()
    first: dict[str, _Op] = {}
    for op, hit in zip(probe.ops, flags, strict=True):
        r = fp32.modules.get(op.module)
        in_range = r is not None and not r.out_nonfinite and r.out_amax <= FP16_MAX
        if hit and in_range and op.module not in first:
            first[op.module] = op
    if not first:
        return None
    found = {m: {"op": op.name, "max_abs_fp32": _shadow(op)} for m, op in first.items()}
    modules = list(found)
    m0, op0 = modules[0], first[modules[0]]
    value = found[m0]["max_abs_fp32"]
    reach = f" (it reaches {value:.4g} in fp32)" if value is not None else ""
    matmul = op0.name in _MATMULS
    others = ", ".join(f"{m!r} ({found[m]['op']})" for m in modules[1:5])
    why = (
        "a matmul such as q @ k.T overflows before the 1/sqrt(d) scale brings it back into range"
        if matmul
        else "an intermediate value leaves fp16's range and a later op of the module brings it back"
    )
    return make(
        "AG361",
        f"Inside {m0!r}, {op0.name} overflows fp16{reach} while the module's fp32 output stays "
        f"within 65504 ({why}); under fp16 autocast it makes inf/NaN that the module-level range "
        "check cannot see." + (f" Also inside: {others}." if len(modules) > 1 else ""),
        detail=repr(m0),
        evidence={"modules": found},
        fix=(
            "Scale before the matmul (q * d**-0.5) @ k.T, or use "
            "F.scaled_dot_product_attention; or keep the module in fp32 "
            f"(keep_fp32={modules[:8]!r}); or train in bf16."
            if matmul
            else f"Keep the module in fp32 (keep_fp32={modules[:8]!r}), normalise before the op "
            "that overflows, or train in bf16."
        ),
    )


def _shadow(op: _Op) -> float | None:
    """Max |x| of ``op`` recomputed from fp32 copies of its inputs (None if it refuses)."""

    def up(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.float() if v.dtype in _LOW else v
        if isinstance(v, (list, tuple)):
            return type(v)(up(x) for x in v)
        return v

    try:
        with torch.no_grad():
            out = op.func(*up(op.args), **up(op.kwargs))
        values = [t.abs().amax().float() for t in flatten_tensors(out) if t.is_floating_point()]
        return float(torch.stack(values).amax()) if values else None
    except Exception:  # noqa: BLE001 - the fp32 value is optional evidence
        return None


def _bce(probe: _InnerProbe) -> Finding | None:
    if not probe.bce:
        return None
    rows = []
    for p, logits, target, where in probe.bce:
        if p.dtype not in _LOW:
            continue  # the sigmoid ran in fp32: it rounds to 1 only past |x| ~ 17
        exact = (p == 1) | (p == 0)
        ref = torch.sigmoid(logits.float())
        inside = (ref > 0) & (ref < 1)
        rounded = exact & inside
        t = target.float().reshape(p.shape) if target.numel() == p.numel() else None
        wrong = (
            rounded & (((p == 1) & (t < 0.5)) | ((p == 0) & (t > 0.5)))
            if t is not None
            else torch.zeros_like(rounded)
        )
        rows.append((where, torch.stack([rounded.sum(), wrong.sum()]), p.numel()))
    if not rows:
        return None
    counts = torch.stack([c for _, c, _ in rows]).tolist()
    hits = [(w, int(r), int(x), n) for (w, _, n), (r, x) in zip(rows, counts, strict=True) if r]
    if not hits:
        return None
    where, n_round, n_wrong, numel = hits[0]
    return make(
        "AG362",
        f"The sigmoid in {where!r} feeds binary_cross_entropy, and in fp16 {n_round} of its "
        f"{numel} probabilities round to exactly 0 or 1 where fp32 keeps them inside (0, 1)"
        f"{f'; {n_wrong} of them are confidently wrong' if n_wrong else ''}. Such a sample's "
        "gradient is exactly zero (sigmoid' = p(1 - p) = 0) and a wrong one costs the clamped "
        "log(0) = 100 from then on: it can never be corrected. One such sample is enough; the "
        "saturated-share check (AG321) needs 10%.",
        detail=repr(where),
        evidence={"module": where, "rounded": n_round, "wrong": n_wrong, "numel": numel},
        fix="Return logits and use F.binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss), "
        "which autocast computes in fp32 from the logits; drop the sigmoid from the model.",
    )
