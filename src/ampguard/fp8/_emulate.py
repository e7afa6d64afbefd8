"""Train ``nn.Linear`` layers in a block-scaled format (MXFP8, NVFP4) by emulation, on any device.

Every matmul of the layer sees its operands as the format stores them, quantised along the
matmul's reduction dimension, and runs in float32 on the dequantised values: the numerics of
training in the format, not its speed. The casts are the plan's (:data:`ampguard.fp8._quant.CASTS`,
plain torch, tested bitwise equal to torchao's ``MXTensor.to_mx`` / ``NVFP4Tensor.to_nvfp4``),
so emulation needs no torchao; one difference: a tensor that is all zeros (an operand whose
per-tensor NVFP4 scale would be 0, and torchao's cast NaN) quantises to zeros.

==========  ==============================  =========================================
matmul      operands                        quantised along (block of the format)
==========  ==============================  =========================================
forward     input ``x``, weight ``W``       in_features
input grad  output grad ``g``, ``W``        out_features (g in the gradient element)
weight grad ``g``, ``x``                    the rows of the batch (zero-padded to a block)
==========  ==============================  =========================================

:func:`emulate` changes the class of the chosen layers (the module objects, their parameters and
the optimizer state stay), so :func:`restore` undoes it exactly. ``ag.compare`` variants
``mxfp8`` / ``nvfp4`` train with it under bf16 autocast, and so do the Guard's precisions of the
same names (:mod:`ampguard.fp8._block`). Cost per matmul: about ten elementwise passes per
operand cast, no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampguard.fp8._formats import FORMATS, LowpFormat
from ampguard.fp8._operand import Operand
from ampguard.fp8._quant import CASTS

__all__ = ["EmulatedLinear", "emulate", "restore"]


def _q(t: torch.Tensor, fmt: LowpFormat, role: str) -> torch.Tensor:
    """``t`` (2-D, float32) quantised along its last dimension, padded to whole blocks; an
    all-zero ``t`` gives zeros (a NaN in ``t`` stays NaN). No host sync."""
    width = t.shape[-1]
    block = max(fmt.block, fmt.multiple)
    pad = -width % block
    if pad:
        t = F.pad(t, (0, pad))
    op = Operand(t)
    q = CASTS[fmt.name](op, role).q  # in op's own scratch buffer: not shared with anything
    return q.masked_fill_(op.amax == 0, 0.0)[..., :width]


class _LowpMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
        fmt = FORMATS[name]
        x2 = x.reshape(-1, x.shape[-1]).float()
        wf = w.float()
        ctx.save_for_backward(x2, wf)
        ctx.fmt, ctx.shape = fmt, x.shape
        y = _q(x2, fmt, "input") @ _q(wf, fmt, "weight").T
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, wf = ctx.saved_tensors
        fmt = ctx.fmt
        g = grad.reshape(-1, grad.shape[-1]).float()
        dx = _q(g, fmt, "grad") @ _q(wf.T, fmt, "weight").T
        dw = _q(g.T, fmt, "grad") @ _q(x2.T, fmt, "input").T
        return dx.reshape(ctx.shape), dw, None


class EmulatedLinear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in ``lowp_format`` (see the module docstring)."""

    lowp_format: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type  # is_autocast_enabled() without it asks about CUDA only
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(x.device.type, enabled=False):
            y = _LowpMatmul.apply(x, self.weight, self.lowp_format)
            if self.bias is not None:
                y = y + self.bias.float()
        return y.to(dtype)


def emulate(
    model: nn.Module, fmt: str, module_filter_fn: Callable[[nn.Module, str], bool] | None = None
) -> list[str]:
    """Train ``model``'s Linear layers that fit ``fmt`` (and ``module_filter_fn``, if given) in
    that format; return their names. Raises ``ValueError`` for an unknown format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown low-precision format {fmt!r}: one of {tuple(FORMATS)}")
    spec = FORMATS[fmt]
    chosen = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or not spec.shape_ok(mod.in_features, mod.out_features):
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, name):
            continue
        mod.__class__ = EmulatedLinear
        mod.__dict__["lowp_format"] = fmt  # plain attribute: Module.__setattr__ wants tensors
        chosen.append(name)
    return chosen


def restore(model: nn.Module) -> None:
    """Undo :func:`emulate`: every emulated layer is a plain ``nn.Linear`` again."""
    for mod in model.modules():
        if isinstance(mod, EmulatedLinear):
            mod.__class__ = nn.Linear  # type: ignore[assignment]
            mod.__dict__.pop("lowp_format", None)
