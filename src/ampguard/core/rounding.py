"""Writing an fp32 value back into bf16/fp16 storage without losing the part below half an ulp.

Two ways, both per element and on the device:

- **Kahan compensation** (:func:`kahan_write`, in place on a flat fp32 stretch:
  :func:`kahan_split_`): the stored weight ``w`` (the value rounded to nearest) and a
  compensation buffer ``c`` of the same shape (int16, 2 bytes per element,
  :func:`kahan_buffer`) hold the fp32 value exactly: ``c`` is the distance from ``float(w)`` to
  the value counted in fp32 spacings, the difference of the two fp32 bit patterns
  (:func:`kahan_read`: ``bits(float(w)) + c``). An update smaller than half an ulp of ``w``
  waits in ``c`` until the sum crosses a representable value, and nothing is rounded twice: no
  random draw, no bias, the fp32 value's own 24 bits. bf16: ``c`` is the fp32 pattern's low 16
  bits read as a signed number and ``w`` its top 16 with that carry (ties round away from zero),
  so the pair is the fp32 value bitwise wherever it is (infinities and NaN stay what they are).
  fp16: ``w`` rounds to nearest even; ``c`` is exact for ``|value| >= 2**-16`` (at most 2**12
  spacings in fp16's normal range); below, fp16's subnormal spacing of 2**-24 is more than the
  32,767 fp32 spacings of such a value that int16 holds, so ``c`` is clamped there (what does
  not fit rounds away, as without a buffer); 0 where ``w`` overflowed to inf (the weight stays
  inf, as without a buffer).
- **Stochastic rounding** (:func:`stochastic_round`, in place on fp32: :func:`stochastic_round_`):
  round up (in magnitude) with probability equal to the distance from the value below, in units
  of the spacing there: unbiased (the expected stored value is the fp32 value), nothing
  persistent, noisy. 16 random bits per element (:func:`draw_noise`: four from each 64-bit
  word; :func:`round_with_noise_` is the rounding for given bits): bf16 adds them to the low 16
  bits of the fp32 pattern and truncates
  (exact: fp32 has exactly 16 bits below bf16's significand); fp16 adds their top 13 bits below
  its 10-bit significand (exact in its normal range) and, below 2**-14 (fp16 subnormals, a fixed
  spacing of 2**-24), all 16 to the distance in units of that spacing, truncated to 16 bits.

The random bits come from a :class:`torch.Generator` the caller owns, so a run resumes bitwise
when its state is saved. Cost: a few elementwise ops per element written; no host sync.
"""

from __future__ import annotations

import torch

__all__ = [
    "COMP_DTYPE",
    "kahan_buffer",
    "kahan_read",
    "kahan_split_",
    "kahan_write",
    "stochastic_round",
    "stochastic_round_",
    "round_with_noise_",
    "draw_noise",
    "NOISE_BITS",
    "nearest_write",
]

NOISE_BITS = 16  # random bits drawn per element
_LOW16 = -65536  # 0xFFFF0000 as an int32: the bits bf16 keeps of an fp32 pattern
_HALF16 = 0x8000  # half of bf16's last place in an fp32 pattern (low 16 bits read signed)
_LOW13 = -8192  # 0xFFFFE000: the bits fp16 keeps of an fp32 pattern in fp16's normal range
_FP16_TINY = 2.0**-14  # fp16's smallest normal value; below it the spacing is 2**-24


COMP_DTYPE = torch.int16  # a Kahan buffer's dtype: fp32 spacings from the stored weight


def kahan_buffer(stored: torch.Tensor) -> torch.Tensor:
    """A zero Kahan buffer for ``stored`` (int16, same shape and device: the stored value is
    the fp32 value exactly)."""
    return torch.zeros(stored.shape, dtype=COMP_DTYPE, device=stored.device)


def kahan_read(stored: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    """The fp32 value that ``stored`` and its buffer ``comp`` hold (a new tensor): the bit
    pattern of ``float(stored)`` plus ``comp``. Cost: a cast and an integer add."""
    value = stored.to(torch.float32, copy=True)
    value.view(torch.int32).add_(comp)
    return value


def kahan_split_(flat: torch.Tensor, dtype: torch.dtype, comp: torch.Tensor) -> torch.Tensor:
    """Split the contiguous fp32 tensor ``flat`` into its rounding to ``dtype`` (left in
    ``flat``, in place: fp32 values exactly representable in ``dtype``) and the buffer ``comp``
    (int16, same number of elements, written) such that :func:`kahan_read` of the two gives the
    old ``flat`` (see the module docstring). Returns ``flat``. Cost: three integer ops (bf16:
    a copy and two scalar ops, not a mixed-dtype subtract, which is about 2.7x slower per
    element on a CPU), about eight ops (fp16); no random draw, no host sync."""
    if flat.dtype != torch.float32 or comp.dtype != COMP_DTYPE:
        raise ValueError(
            f"kahan_split_: flat must be float32 and comp int16, got {flat.dtype}, {comp.dtype}"
        )
    bits = flat.view(torch.int32)
    same = comp.shape == bits.shape  # a flat stretch and its flat buffer: no view needed
    into = comp if same else comp.view(bits.shape)
    if dtype == torch.bfloat16:
        into.copy_(bits)  # the low 16 bits, signed (the copy wraps)
        bits.add_(_HALF16).bitwise_and_(_LOW16)  # bits - into: the top 16, with the carry
        return flat
    if dtype != torch.float16:
        raise ValueError(f"Kahan compensation: dtype must be bfloat16 or float16, got {dtype}")
    near = flat.to(torch.float16).to(torch.float32)
    spacings = bits.sub_(near.view(torch.int32))  # flat's bits are spent: it becomes near
    spacings.clamp_(-(2**15), 2**15 - 1).masked_fill_(near.isinf(), 0)
    into.copy_(spacings)
    return flat.copy_(near)


def kahan_write(value: torch.Tensor, stored: torch.Tensor, comp: torch.Tensor) -> None:
    """Store fp32 ``value`` as ``stored`` (rounded to nearest) and its Kahan buffer ``comp``
    (int16) so that :func:`kahan_read` gives ``value`` back (exactly; fp16: for ``|value| >=
    2**-16``). ``value`` is left as it is. Cost: a copy and :func:`kahan_split_`."""
    flat = value.to(torch.float32, copy=True).contiguous()
    stored.copy_(kahan_split_(flat, stored.dtype, comp).view_as(stored))


def nearest_write(value: torch.Tensor, stored: torch.Tensor) -> None:
    """Store fp32 ``value`` rounded to nearest (what the optimizer would have written)."""
    stored.copy_(value)


def stochastic_round(
    value: torch.Tensor,
    dtype: torch.dtype,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``value`` rounded to ``dtype`` (bf16 or fp16) stochastically (see the module docstring;
    ``value`` is left as it is). Infinities and NaN stay what they are; a finite value within
    one spacing of the largest rounds up to inf with the probability of its distance. Cost:
    about four elementwise ops (fp16: about twelve) and one random draw per element; no host
    sync."""
    rounded = stochastic_round_(value.to(torch.float32, copy=True), dtype, generator)
    return rounded.to(dtype) if out is None else out.copy_(rounded)


def stochastic_round_(
    flat: torch.Tensor, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """Round the contiguous fp32 tensor ``flat`` stochastically to values of ``dtype``, in
    place (they stay fp32, exactly representable in ``dtype``), with :data:`NOISE_BITS` random
    bits per element from :func:`draw_noise` in element order; returns ``flat``. Cost: one
    draw and :func:`round_with_noise_`."""
    noise = draw_noise(flat.numel(), generator, flat.device)
    return round_with_noise_(flat, dtype, noise if flat.dim() == 1 else noise.view(flat.shape))


def draw_noise(numel: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``numel`` independent uniform 16-bit values (int32 in ``[0, 2**16)``, flat): the four
    16-bit quarters of each uniform 64-bit word drawn from ``generator`` (``random_`` over the
    full int64 range), in order. A quarter of the generator calls of one draw per element
    (``torch.randint`` costs about 3 ns an element on a CPU). Cost: the draw and one pass (two
    off the CPU)."""
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)
    if words.device.type == "cpu":  # read unsigned: no mask pass (measured on the CPU only)
        quarters = words.view(torch.uint16)
        return (quarters if numel % 4 == 0 else quarters[:numel]).to(torch.int32)
    return words.view(torch.int16)[:numel].to(torch.int32).bitwise_and_(0xFFFF)


def round_with_noise_(flat: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """The stochastic rounding of fp32 ``flat`` (contiguous, in place) to ``dtype`` given the
    random bits ``noise`` (int32 in ``[0, 2**16)``, same shape; modified): over all 2**16 noise
    values, the share that rounds a value up (in magnitude) is its distance from the value of
    ``dtype`` below, in units of the spacing there (fp16 below 2**-14: truncated to 16 bits of
    the spacing). Returns ``flat``. Cost: two integer ops (bf16), about twelve (fp16)."""
    if flat.dtype != torch.float32:
        raise ValueError(f"round_with_noise_: flat must be float32, got {flat.dtype}")
    bits = flat.view(torch.int32)
    if dtype == torch.bfloat16:
        bits.add_(noise).bitwise_and_(_LOW16)
        return flat
    if dtype != torch.float16:
        raise ValueError(f"stochastic rounding: dtype must be bfloat16 or float16, got {dtype}")
    magnitude = flat.abs()
    tiny = magnitude < _FP16_TINY  # zero and fp16 subnormals: multiples of 2**-24
    # the distance in units of 2**-40 (2**-16 of the spacing), plus the noise, in spacings
    spacings = magnitude.clamp_(max=_FP16_TINY).mul_(2.0**40).to(torch.int32)
    spacings.add_(noise).bitwise_right_shift_(NOISE_BITS)
    small = spacings.to(torch.float32).mul_(2.0**-24).copysign_(flat)
    bits.add_(noise.bitwise_right_shift_(NOISE_BITS - 13)).bitwise_and_(_LOW13)
    return torch.where(tiny, small, flat, out=flat)
