"""Low-precision training formats as values: one registry entry per format, one quantiser each.

A :class:`LowpFormat` says how a tensor is stored when a matmul trains in that format: the
element dtype of its values (forward: input and weight; backward: the output gradient), how
values share a scale (per tensor, per row, or per block of ``block`` consecutive values along
the last dimension) and what a layer's shape must satisfy. ``quantize`` returns the tensor as
the format stores it, dequantised to float32, with the scale each value used; the plan
(:mod:`ampguard.fp8._multi`) measures every figure from that pair, so what it reports is what
the cast does.

=============  ===========================  =======  ======================================
format         values (forward / gradient)  block    scale
=============  ===========================  =======  ======================================
``tensorwise`` e4m3 / e5m2                  tensor   fp32 ``fp8_max / amax`` (torchao float8)
``rowwise``    e4m3 / e4m3                  row      power of two per row (torchao float8)
``mxfp8``      e4m3 / e5m2                  32       e8m0 per block (OCP MX, RCEIL rounding)
``nvfp4``      e2m1 / e2m1                  16       e4m3 per block x fp32 per tensor
``fp8_blockw`` e4m3 / e4m3                  128      fp32 ``448 / amax`` per 1x128 tile of an
``ise``                                              input/gradient, per 128x128 weight block
=============  ===========================  =======  ======================================

``fp8_blockwise`` is DeepSeek-V3's (and TransformerEngine's block scaling) fp8: activations and
gradients share a scale per 1x128 tile along the matmul's reduction dimension, weights per
128x128 block (rows x columns: the same blocks under transposition, so the weight's forward and
backward casts agree); in and out features must be multiples of 128. The weight's blocks are
whole 128-row groups of the tensor it is given (the plan's sampled rows: an approximation of the
true blocks there; emulation casts the whole weight, exactly).

``tensorwise`` and ``rowwise`` are cast in plain torch (:mod:`ampguard.fp8._cast`, what torchao's
float8 training does); ``mxfp8`` and ``nvfp4`` use torchao's own quantisers
(``MXTensor.to_mx``, ``NVFP4Tensor.to_nvfp4``), which run on any device: ``quantize`` is the
reference, and what training by emulation (:mod:`ampguard.fp8._emulate`) casts with. The plan
measures with :data:`ampguard.fp8._quant.CASTS`, the same casts written for a CPU and tested
bitwise equal to these. Adding a format is one entry here and one cast there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ampguard.fp8._cast import E4M3, E5M2, RECIPES

__all__ = [
    "LowpFormat",
    "FORMATS",
    "Quantized",
    "lookup",
    "check_formats",
    "tile_amax",
    "BLOCKWISE_TILE",
]

Quantized = tuple[torch.Tensor, torch.Tensor]  # (dequantised float32 values, per-value scale)


@dataclass(frozen=True)
class LowpFormat:
    """One low-precision format: name, bits per value, element dtypes, block, quantiser.

    ``bits`` orders formats from the lowest precision (``plan.recipe`` picks the lowest that
    keeps a layer within tolerance); ``block`` is the number of consecutive values (along the
    last dimension) that share a scale, 0 for one scale per tensor, -1 for one per row;
    ``multiple`` is what both matmul dimensions must be divisible by.
    """

    name: str
    bits: int
    forward: str  # element type of input and weight, in words ("e4m3")
    gradient: str  # element type of the output gradient
    mantissa_bits: int  # of the forward element type (rounding: half an ulp is 2**-(m+1))
    block: int
    multiple: int
    description: str
    quantize: Callable[[torch.Tensor, str], Quantized]

    def shape_ok(self, in_features: int, out_features: int) -> bool:
        """True when a Linear of this shape can train in the format."""
        dims = (in_features, out_features)
        return all(d > 0 and d % self.multiple == 0 for d in dims)

    def element(self, role: str) -> str:
        """The element type (in words) that a tensor of ``role`` is stored in."""
        return self.gradient if role == "grad" else self.forward


def _float8(recipe_name: str) -> Callable[[torch.Tensor, str], Quantized]:
    recipe = RECIPES[recipe_name]

    def quantize(x: torch.Tensor, role: str) -> Quantized:
        dtype = recipe.grad_dtype if role == "grad" else E4M3
        xf = x.float()
        a = xf.abs()
        amax = a.amax(dim=-1, keepdim=True) if recipe.rowwise else a.amax()
        fmax = torch.finfo(dtype).max
        scale = fmax / amax.clamp(min=1e-12)
        if recipe.pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        q = (xf * scale).clamp(-fmax, fmax).to(dtype).float() / scale
        return q, (1.0 / scale).expand_as(xf)

    return quantize


@functools.cache
def _torchao_mx() -> tuple[Any, Any]:
    from ampguard.fp8._torchao import require_torchao

    require_torchao()  # the clear "pip install ampguard[fp8]" error, quiet import
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    return MXTensor, NVFP4Tensor


BLOCKWISE_TILE = 128  # fp8_blockwise: 1x128 tiles, 128x128 weight blocks


def tile_amax(t: torch.Tensor, tile: int = BLOCKWISE_TILE) -> torch.Tensor:
    """The amax of each ``tile x tile`` block of a 2-D ``t`` (rows padded with zeros to whole
    tiles; the width must divide), one per row and column block: shape (rows, width / tile)."""
    rows = t.shape[0]
    b = t.abs().reshape(rows, -1, tile).amax(dim=-1)
    pad = -rows % tile
    if pad:
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    blocks = b.view(-1, tile, b.shape[-1]).amax(dim=1)
    return blocks.repeat_interleave(tile, dim=0)[:rows]


def _fp8_blockwise(x: torch.Tensor, role: str) -> Quantized:
    xf = x.float().reshape(-1, x.shape[-1])
    tile = BLOCKWISE_TILE
    amax = tile_amax(xf) if role == "weight" else xf.abs().view(xf.shape[0], -1, tile).amax(-1)
    fmax = torch.finfo(E4M3).max
    scale = (fmax / amax.clamp(min=1e-12)).unsqueeze(-1)
    blocks = xf.view(xf.shape[0], -1, tile)
    q = (blocks * scale).clamp(-fmax, fmax).to(E4M3).float() / scale
    per_value = (1.0 / scale).expand_as(blocks)
    return q.reshape(x.shape), per_value.reshape(x.shape)


def _mxfp8(x: torch.Tensor, role: str) -> Quantized:
    mx_tensor, _ = _torchao_mx()
    dtype = E5M2 if role == "grad" else E4M3
    xf = x.float().contiguous()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    # RCEIL: the scale torchao's MXFP8 training uses (FLOOR, the spec's default, clips the top
    # of a block's range)
    mx = mx_tensor.to_mx(xf, dtype, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    scale = mx.scale.float().reshape(*xf.shape[:-1], -1, 1)  # e8m0: the power of two itself
    per_value = scale.expand(*xf.shape[:-1], xf.shape[-1] // 32, 32).reshape(xf.shape)
    return mx.dequantize(torch.float32), per_value


def _nvfp4(x: torch.Tensor, role: str) -> Quantized:
    _, nvfp4_tensor = _torchao_mx()
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

    xf = x.float().reshape(-1, x.shape[-1]).contiguous()
    tensor_scale = per_tensor_amax_to_scale(xf.abs().amax())
    q = nvfp4_tensor.to_nvfp4(xf, 16, per_tensor_scale=tensor_scale)
    block = q.scale.float().reshape(xf.shape[0], -1, 1) * tensor_scale
    per_value = block.expand(xf.shape[0], xf.shape[1] // 16, 16).reshape(xf.shape)
    return q.dequantize(torch.float32).reshape(x.shape), per_value.reshape(x.shape)


FORMATS: dict[str, LowpFormat] = {
    f.name: f
    for f in (
        LowpFormat(
            "tensorwise", 8, "e4m3", "e5m2", 3, 0, 16,
            "fp8, one fp32 scale per tensor (torchao float8 'tensorwise')", _float8("tensorwise"),
        ),
        LowpFormat(
            "rowwise", 8, "e4m3", "e4m3", 3, -1, 16,
            "fp8, a power-of-two scale per row (torchao float8 'rowwise')", _float8("rowwise"),
        ),
        LowpFormat(
            "mxfp8", 8, "e4m3", "e5m2", 3, 32, 32,
            "MXFP8: e4m3 values, an e8m0 scale per 32 (OCP microscaling)", _mxfp8,
        ),
        LowpFormat(
            "nvfp4", 4, "e2m1", "e2m1", 1, 16, 16,
            "NVFP4: e2m1 values, an e4m3 scale per 16 and an fp32 scale per tensor", _nvfp4,
        ),
        LowpFormat(
            "fp8_blockwise", 8, "e4m3", "e4m3", 3, 128, 128,
            "fp8 e4m3, an fp32 scale per 1x128 tile (per 128x128 block of a weight; DeepSeek-V3)",
            _fp8_blockwise,
        ),
    )
}  # fmt: skip


def lookup(name: str) -> LowpFormat:
    """The registered format called ``name``; ``ValueError`` naming the allowed ones."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        allowed = tuple(FORMATS)
        raise ValueError(f"unknown low-precision format {name!r}: one of {allowed}") from None


def check_formats(formats: object) -> tuple[str, ...]:
    """``formats=`` as a tuple of known names (a single name is accepted); clear errors."""
    if isinstance(formats, str):
        formats = (formats,)
    if not isinstance(formats, (tuple, list)) or not formats:
        raise TypeError(
            f"formats must be a non-empty tuple of format names from {tuple(FORMATS)}, "
            f"got {formats!r}"
        )
    names = []
    for f in formats:
        if not isinstance(f, str) or f not in FORMATS:
            raise ValueError(f"formats: unknown format {f!r}; allowed: {tuple(FORMATS)}")
        if f not in names:
            names.append(f)
    return tuple(names)


def half_ulp(fmt: LowpFormat) -> float:
    """The largest relative rounding error of a normal value in the format's forward type."""
    return math.ldexp(1.0, -(fmt.mantissa_bits + 1))
