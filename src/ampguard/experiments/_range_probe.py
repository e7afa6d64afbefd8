"""One fp32 forward/backward probe of per-module value ranges (used by the model advisor).

For every module the probe records the largest magnitude of its inputs and outputs, the share of
nonzero outputs fp16 would flush to zero, how many sigmoid/tanh outputs fp16 would round to 1,
and a log2 histogram of its gradients (gradients of its outputs and of its own parameters), so the
advisor can ask "what would fp16 do to these values at loss scale S" for any S without rerunning.
The model's buffers, gradients and the RNG are restored afterwards and no hook is left behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampguard._util.tensors import device_type as _device_type

__all__ = ["ModuleRange", "ProbeResult", "run_probe", "FP16_MAX", "FP16_FLUSH_LOG2"]

FP16_MAX = 65504.0
# |x| <= 2**-25 rounds to zero in fp16 (half of the smallest subnormal, 2**-24, ties to even).
FP16_FLUSH_LOG2 = -25
# fp16's spacing just below 1 is 2**-11, so 1 - |y| <= 2**-12 rounds |y| to exactly 1.
_FP16_ONE_GAP = 2.0**-12
_HIST_OFFSET = 160  # fp32 exponents from frexp lie in [-148, 129]
_HIST_BINS = 300
_SMOOTH_SATURATING = (nn.Sigmoid, nn.Tanh, nn.Softsign)
# modules whose ops autocast runs in fp16, casting an fp32 input down (matmul/conv families)
_FP16_CASTING = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.MultiheadAttention,
    nn.RNNBase,
)


@dataclass
class ModuleRange:
    """Value ranges of one module over the probe (merged over repeated calls)."""

    name: str
    order: int  # position in forward completion order (children finish before parents)
    has_params: bool
    leaf: bool
    casts_fp16: bool  # autocast would cast its (fp32) input to fp16: matmul/conv or custom code
    in_amax: float = 0.0
    out_amax: float = 0.0
    out_nonfinite: bool = False
    out_nonzero: int = 0
    out_flushed: int = 0  # nonzero outputs that fp16 rounds to zero
    saturating: int = 0  # outputs that fp16 rounds to +-1 but fp32 does not (sigmoid/tanh)
    saturating_total: int = 0
    grad_amax: float = 0.0
    grad_nonfinite: bool = False
    grad_hist: torch.Tensor | None = field(default=None, repr=False)

    def flushed_fraction(self) -> float:
        """Share of this module's nonzero outputs that fp16 flushes to zero."""
        return self.out_flushed / self.out_nonzero if self.out_nonzero else 0.0

    def saturated_fraction(self) -> float:
        """Share of this module's outputs that saturate to +-1 in fp16 only."""
        return self.saturating / self.saturating_total if self.saturating_total else 0.0

    def grad_flushed_fraction(self, scale: float) -> float:
        """Share of nonzero gradient values that fp16 flushes to zero at loss scale ``scale``."""
        if self.grad_hist is None:
            return 0.0
        total = float(self.grad_hist.sum())
        if total == 0.0:
            return 0.0
        shift = int(torch.tensor(float(scale)).log2().floor())
        # a value below 2**e (frexp exponent e) times 2**shift is below 2**-25 when e+shift <= -25
        cut = FP16_FLUSH_LOG2 - shift + _HIST_OFFSET
        cut = max(0, min(_HIST_BINS, cut + 1))
        return float(self.grad_hist[:cut].sum()) / total


@dataclass
class ProbeResult:
    """Everything one probe measured: per-module ranges, the loss, custom autograd Functions."""

    modules: dict[str, ModuleRange]
    loss: float | None
    functions: list[type] = field(default_factory=list)

    def ordered(self) -> list[ModuleRange]:
        """Modules in forward completion order."""
        return sorted(self.modules.values(), key=lambda r: r.order)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Floating tensors inside a (nested) tuple/list/dict output."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _log2_hist(values: torch.Tensor) -> torch.Tensor:
    """Counts of nonzero finite |values| by frexp exponent (offset by ``_HIST_OFFSET``)."""
    a = values.detach().abs().float().flatten()
    a = a[(a != 0) & torch.isfinite(a)]
    exp = torch.frexp(a).exponent.long() + _HIST_OFFSET
    return torch.bincount(exp.clamp(0, _HIST_BINS - 1), minlength=_HIST_BINS).cpu()


class _Recorder:
    """Forward hooks on every module; tensor hooks on their outputs for the gradients."""

    def __init__(self, model: nn.Module) -> None:
        self.ranges: dict[str, ModuleRange] = {}
        self._names = {id(m): n for n, m in model.named_modules()}
        self._handles: list[Any] = []
        for module in model.modules():
            self._handles.append(module.register_forward_hook(self._on_forward))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _range(self, module: nn.Module) -> ModuleRange:
        name = self._names[id(module)]
        if name not in self.ranges:
            has_params = any(True for _ in module.parameters(recurse=False))
            custom = not type(module).__module__.startswith("torch.")
            self.ranges[name] = ModuleRange(
                name=name,
                order=len(self.ranges),
                has_params=has_params,
                leaf=not any(True for _ in module.children()),
                casts_fp16=isinstance(module, _FP16_CASTING) or (has_params and custom),
            )
        return self.ranges[name]

    def _on_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        r = self._range(module)
        with torch.no_grad():
            for t in _tensors(args):
                a = t.detach().abs().float()
                finite = a[torch.isfinite(a)]
                if finite.numel():
                    r.in_amax = max(r.in_amax, float(finite.max()))
            for t in _tensors(output):
                self._record_output(module, r, t)
                if t.requires_grad:
                    t.register_hook(lambda g, r=r: self.record_grad(r, g))

    @staticmethod
    def _record_output(module: nn.Module, r: ModuleRange, t: torch.Tensor) -> None:
        a = t.detach().abs().float()
        finite = torch.isfinite(a)
        if not bool(finite.all()):
            r.out_nonfinite = True
        a = a[finite]
        if a.numel():
            r.out_amax = max(r.out_amax, float(a.max()))
        nonzero = a[a != 0]
        r.out_nonzero += nonzero.numel()
        r.out_flushed += int((nonzero <= 2.0**FP16_FLUSH_LOG2).sum())
        if isinstance(module, _SMOOTH_SATURATING):
            gap = 1.0 - a
            r.saturating += int(((gap > 0) & (gap <= _FP16_ONE_GAP)).sum())
            r.saturating_total += a.numel()

    @staticmethod
    def record_grad(r: ModuleRange, grad: torch.Tensor) -> None:
        """Fold one gradient's magnitudes into ``r`` (from an output's grad hook, or a parameter's
        ``.grad`` after backward). Cost: host syncs; the probe runs outside training."""
        with torch.no_grad():
            a = grad.detach().abs().float()
            finite = torch.isfinite(a)
            if not bool(finite.all()):
                r.grad_nonfinite = True
            if bool(finite.any()):
                r.grad_amax = max(r.grad_amax, float(a[finite].max()))
            hist = _log2_hist(a)
            r.grad_hist = hist if r.grad_hist is None else r.grad_hist + hist


def _custom_functions(loss: torch.Tensor) -> list[type]:
    """Custom ``autograd.Function`` classes in the graph behind ``loss``, in discovery order."""
    found: list[type] = []
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)  # torch private: a custom Function's class
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Restore buffers (e.g. BatchNorm running stats), gradients and the RNG afterwards."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    grads = {p: p.grad for p in model.parameters()}
    cuda = [t.device for t in [*buffers.values(), *grads] if t.device.type == "cuda"]
    devices = sorted({torch.cuda.current_device() if d.index is None else d.index for d in cuda})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    if name in buffers:
                        buf.copy_(buffers[name])
            for p, g in grads.items():
                p.grad = g


def run_probe(
    model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
) -> ProbeResult:
    """Run ``loss_fn(model, batch)`` (or ``model(batch)``) in fp32 with range hooks; then backward.

    Without ``loss_fn`` only the forward is probed (no gradient ranges).
    Cost: one fp32 forward (+ backward) with a host sync per module output and gradient.
    """
    with _restored(model):
        for p in model.parameters():
            p.grad = None
        recorder = _Recorder(model)
        try:
            with torch.autocast(_device_type(model), enabled=False):
                out = loss_fn(model, batch) if loss_fn is not None else model(batch)
            loss = None
            functions: list[type] = []
            if loss_fn is not None:
                loss = _as_loss(out)
                functions = _custom_functions(loss)
                if loss.requires_grad:
                    loss.backward()
                    _record_param_grads(model, recorder)
        finally:
            recorder.remove()
    return ProbeResult(recorder.ranges, None if loss is None else float(loss.detach()), functions)


def _as_loss(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise TypeError(
            "loss_fn(model, batch) must return a scalar tensor (the loss), "
            f"got {type(out).__name__}{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}"
        )
    return out.reshape(())


def _record_param_grads(model: nn.Module, recorder: _Recorder) -> None:
    for name, module in model.named_modules():
        r = recorder.ranges.get(name)
        if r is None:
            continue
        for p in module.parameters(recurse=False):
            if p.grad is not None:
                recorder.record_grad(r, p.grad)
