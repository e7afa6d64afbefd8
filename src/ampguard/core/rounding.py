"""Writing an fp32 value back into bf16/fp16 storage without losing the part below half an ulp.

Two ways, both per element and on the device:

- **Kahan compensation** (:func:`kahan_write`): the stored weight ``w`` and a compensation buffer
  ``c`` of the same shape (in the weight's own dtype, 2 bytes per element) together hold the
  fp32 value: ``value ~ w + c``. Writing ``v`` stores ``w = round(v)`` and ``c = round(v - w)``,
  so an update smaller than half an ulp of ``w`` waits in ``c`` until the sum crosses a
  representable value (:func:`kahan_read` gives ``w + c`` in fp32). About 16 significant bits for
  bf16 instead of 8; the buffer is rounded stochastically (unbiased below those 16 bits).
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
    "kahan_read",
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
_LOW13 = -8192  # 0xFFFFE000: the bits fp16 keeps of an fp32 pattern in fp16's normal range
_FP16_TINY = 2.0**-14  # fp16's smallest normal value; below it the spacing is 2**-24


def kahan_read(stored: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    """The fp32 value ``stored + comp`` (a new tensor). Cost: a cast and an add."""
    return stored.float().add_(comp)


def kahan_write(
    value: torch.Tensor,
    stored: torch.Tensor,
    comp: torch.Tensor,
    generator: torch.Generator | None = None,
) -> None:
    """Store fp32 ``value`` as ``stored = round(value)``, ``comp = round(value - stored)`` (in
    place; ``stored``/``comp`` keep their dtype). With ``generator`` the compensation itself is
    rounded stochastically: a nearest-rounded buffer holds only 8 bits of the residual (bf16),
    so a steady update smaller than its own spacing (weight decay of 1e-5 a step) would be
    biased, by up to half of it. Cost: about four elementwise ops (and one draw)."""
    stored.copy_(value)
    residual = torch.sub(value, stored)  # fp32 (the promoted type); exact
    if generator is None:
        comp.copy_(residual)
    else:
        comp.copy_(stochastic_round_(residual, comp.dtype, generator))


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
