"""The plan's quantisers: each format's cast of one :class:`~ampguard.fp8._operand.Operand`,
in plain torch, bitwise equal to the cast it stands for.

===============  ===========================================================================
format           the cast reproduced (tested bitwise against it, ``tests/test_lowp_quant.py``)
===============  ===========================================================================
``tensorwise``   torchao float8: ``fp8_max / amax`` per tensor (:mod:`ampguard.fp8._cast`)
``rowwise``      torchao float8: a power of two per row, e4m3 for every role
``mxfp8``        torchao ``MXTensor.to_mx(x, dtype, 32, RCEIL)`` then ``dequantize``
``nvfp4``        torchao ``NVFP4Tensor.to_nvfp4(x, 16, per_tensor_scale)`` then ``dequantize``
``fp8_blockwise`` the registry's plain-torch cast (``448 / amax`` per 1x128 tile / 128x128 block)
===============  ===========================================================================

Why not call torchao: its MX / NVFP4 quantisers are written for GPUs (NVFP4's element cast is
about 30 integer ops per value, and a CPU's fp8-to-float32 conversion is slow); the plan runs
them on up to 12 tensors per layer. Here each cast reads the amaxes the operand shares between
formats and rounds with one float trick (:func:`round_to_grid`: adding a constant whose ulp is
the element's spacing rounds to nearest even, as the hardware cast does): about ten elementwise
passes per cast.

Every cast returns a :class:`Cast`: ``q`` (the dequantised values, float32, shape of the
tensor), ``scale`` (the dequantisation scale of each block: 0-d per tensor, (rows, 1) per row,
(rows, blocks, 1) per block) and ``amax`` (what each scale was set from, same shape). ``q``
lives in the operand's scratch buffer 0 until its next cast. Cost: no host sync, no allocation
of the tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ampguard.fp8._formats import BLOCKWISE_TILE, FORMATS, tile_amax
from ampguard.fp8._operand import Operand

__all__ = ["Cast", "ELEMENTS", "round_to_grid", "CASTS"]

_EPS = 1e-12  # torchao float8's floor on amax before dividing
_E8M0_BIAS = 127
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_NVFP4_SCALE_MIN = float(torch.finfo(torch.float8_e4m3fn).tiny)  # torchao's E4M3_EPS


class Element(NamedTuple):
    """A floating point element type: mantissa bits, biased float32 exponent of its smallest
    normal value, largest finite value."""

    mantissa_bits: int
    min_normal_field: int
    max: float


ELEMENTS = {
    "e4m3": Element(3, 127 - 6, 448.0),
    "e5m2": Element(2, 127 - 14, 57344.0),
    "e2m1": Element(1, 127, 6.0),
}


class Cast(NamedTuple):
    """A tensor as a format stores it: dequantised values, per-block scale and amax."""

    q: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor


def round_to_grid(
    t: torch.Tensor, element: Element, buf: torch.Tensor | None = None
) -> torch.Tensor:
    """Round ``t`` (float32, ``|t| <= element.max``) to ``element``'s values, to nearest even,
    subnormals included, in place; returned.

    ``c = 1.5 * 2**(E + 23 - m)`` (``E`` the exponent of ``|t|``, at least the smallest
    normal's; ``m`` the mantissa bits) keeps ``c + t`` in one binade whose ulp is the element's
    spacing at ``t``, so ``(t + c) - c`` is ``t`` rounded as the hardware cast rounds it (a
    value that rounds to zero gives +0 where the cast gives -0: equal as numbers). Five passes,
    no integer shift. ``buf``: float32 scratch of ``t``'s shape (or None)."""
    out = None if buf is None else buf.view(torch.int32).view(t.shape)
    c = torch.bitwise_and(t.view(torch.int32), 0x7F800000, out=out).view(torch.float32)  # 2**E
    c.clamp_(min=math.ldexp(1.0, element.min_normal_field - 127))
    c.mul_(1.5 * math.ldexp(1.0, 23 - element.mantissa_bits))
    return t.add_(c).sub_(c)


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    return t.view(t.shape[0], -1, block)


def _element(name: str, role: str) -> Element:
    """The element type format ``name`` stores a tensor of ``role`` in (the registry's)."""
    return ELEMENTS[FORMATS[name].element(role)]


def _fp8_scaled(op: Operand, amax: torch.Tensor, el: Element, pow2: bool) -> Cast:
    """torchao float8: ``scale = fp8_max / amax`` (rounded down to a power of two for
    rowwise), ``q = cast(clamp(x * scale)) / scale``."""
    scale = el.max / amax.clamp(min=_EPS)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    t = torch.mul(op.x, scale, out=op.scratch(0)).clamp_(-el.max, el.max)
    return Cast(round_to_grid(t, el, op.scratch(1)).div_(scale), 1.0 / scale, amax)


def tensorwise(op: Operand, role: str) -> Cast:
    return _fp8_scaled(op, op.amax, _element("tensorwise", role), pow2=False)


def rowwise(op: Operand, role: str) -> Cast:
    return _fp8_scaled(op, op.row_amax, _element("rowwise", role), pow2=True)


def mxfp8(op: Operand, role: str) -> Cast:
    """``MXTensor.to_mx(x, e4m3 | e5m2, 32, RCEIL)``: ``e = clamp(ceil(log2(amax / max)),
    -127, 127)``, values times ``2**-e`` (1 when the biased exponent is 0), clamped and cast;
    dequantised times ``2**e`` (computed as torchao does)."""
    el = _element("mxfp8", role)
    amax = op.block_amax(32).unsqueeze(-1)
    # the unbiased e8m0 exponent, an integer in float32 (torchao stores it biased, in uint8)
    # (amax floored at float32's smallest normal: the same exponent once clamped, and no
    # log2(0) = -inf for an all-zero block, which ag.locate would see as a non-finite value)
    e = torch.ceil(torch.log2(amax.clamp(min=_F32_TINY) / el.max)).clamp_(-_E8M0_BIAS, _E8M0_BIAS)
    rcp = torch.where(e == -_E8M0_BIAS, 1.0, torch.exp2(-e))
    scale = torch.pow(torch.full_like(e, 2.0), e)  # torchao's get_fp_scale
    t = torch.mul(_blocks(op.x, 32), rcp, out=_blocks(op.scratch(0), 32))
    q = round_to_grid(t.clamp_(-el.max, el.max), el, op.scratch(1)).mul_(scale)
    return Cast(q.view(op.rows, op.width), scale, amax)


def nvfp4(op: Operand, role: str) -> Cast:
    """``NVFP4Tensor.to_nvfp4(x, 16, per_tensor_scale=amax / (448 * 6))``: block scale
    ``amax_block / 6 / per_tensor_scale`` clamped to [e4m3 tiny, 448] and cast to e4m3, values
    times ``(1 / per_tensor_scale) / block_scale``, clamped to 6 and rounded to e2m1;
    dequantised times ``per_tensor_scale * block_scale``."""
    el = _element("nvfp4", role)
    tensor_scale = op.amax.to(torch.float32) / (448.0 * 6.0)
    amax = op.block_amax(16).unsqueeze(-1)
    block = (amax / 6.0) / tensor_scale
    block = block.clamp(min=_NVFP4_SCALE_MIN, max=448.0).to(torch.float8_e4m3fn).float()
    rcp = (1.0 / tensor_scale) / block
    scale = tensor_scale * block
    t = torch.mul(_blocks(op.x, 16), rcp, out=_blocks(op.scratch(0), 16))
    q = round_to_grid(t.clamp_(-el.max, el.max), el, op.scratch(1)).mul_(scale)
    return Cast(q.view(op.rows, op.width), scale, amax)


def fp8_blockwise(op: Operand, role: str) -> Cast:
    """DeepSeek-V3's fp8: ``scale = 448 / amax`` (fp32) per 1x128 tile of an input or
    gradient, per 128x128 block of a weight (the scale and amax repeated on each row of the
    block, so every figure reads them as per-row blocks); values e4m3."""
    el = _element("fp8_blockwise", role)
    tile = BLOCKWISE_TILE
    amax = (tile_amax(op.x) if role == "weight" else op.block_amax(tile)).unsqueeze(-1)
    scale = el.max / amax.clamp(min=_EPS)
    t = torch.mul(_blocks(op.x, tile), scale, out=_blocks(op.scratch(0), tile))
    q = round_to_grid(t.clamp_(-el.max, el.max), el, op.scratch(1)).div_(scale)
    return Cast(q.view(op.rows, op.width), 1.0 / scale, amax)


CASTS: dict[str, Callable[[Operand, str], Cast]] = {
    "tensorwise": tensorwise,
    "rowwise": rowwise,
    "mxfp8": mxfp8,
    "nvfp4": nvfp4,
    "fp8_blockwise": fp8_blockwise,
}
