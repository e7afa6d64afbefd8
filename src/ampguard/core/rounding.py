"""Writing an fp32 value back into bf16/fp16 storage without losing the part below half an ulp.

Two ways, both per element and on the device:

- **Kahan compensation** (:func:`kahan_write`): the stored weight ``w`` and a compensation buffer
  ``c`` of the same shape (in the weight's own dtype, 2 bytes per element) together hold the
  fp32 value: ``value ~ w + c``. Writing ``v`` stores ``w = round(v)`` and ``c = round(v - w)``,
  so an update smaller than half an ulp of ``w`` waits in ``c`` until the sum crosses a
  representable value (:func:`kahan_read` gives ``w + c`` in fp32). About 16 significant bits for
  bf16 instead of 8; the buffer is rounded stochastically (unbiased below those 16 bits).
- **Stochastic rounding** (:func:`stochastic_round`): round up with probability equal to the
  distance from the value below, in units of the spacing there: unbiased (the expected stored
  value is the fp32 value), nothing persistent, noisy. bf16 uses the bit trick (add 16 random
  bits to the fp32 pattern, truncate); fp16 picks between the two neighbours.

The random bits come from a :class:`torch.Generator` the caller owns, so a run resumes bitwise
when its state is saved. Cost: a few elementwise ops per element written; no host sync.
"""

from __future__ import annotations

import torch

__all__ = ["kahan_read", "kahan_write", "stochastic_round", "nearest_write"]

_LOW16 = -65536  # 0xFFFF0000 as an int32: the bits bf16 keeps of an fp32 pattern


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
    residual = torch.sub(value, stored)  # fp32: the promoted type
    if generator is None:
        comp.copy_(residual)
    else:
        stochastic_round(residual, comp.dtype, generator, out=comp)


def nearest_write(value: torch.Tensor, stored: torch.Tensor) -> None:
    """Store fp32 ``value`` rounded to nearest (what the optimizer would have written)."""
    stored.copy_(value)


def stochastic_round(
    value: torch.Tensor,
    dtype: torch.dtype,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``value`` (fp32) rounded to ``dtype`` (bf16 or fp16) stochastically: up with probability
    equal to its distance from the neighbour below in units of the spacing there (unbiased).
    Infinities and torch's NaN stay what they are (bf16: their low 16 bits are zero); a finite
    value within half an ulp of the largest rounds up to inf with that probability. Cost: about
    four elementwise ops and one random draw per element; no host sync."""
    value = value.float()
    if dtype == torch.bfloat16:
        noise = torch.randint(
            0, 1 << 16, value.shape, dtype=torch.int32, device=value.device, generator=generator
        )
        rounded = noise.add_(value.view(torch.int32)).bitwise_and_(_LOW16).view(torch.float32)
        if out is not None:  # written straight into the bf16 storage (exact: low bits zero)
            return out.copy_(rounded)
        return rounded.to(torch.bfloat16)
    if dtype != torch.float16:
        raise ValueError(f"stochastic_round: dtype must be bfloat16 or float16, got {dtype}")
    near = value.to(torch.float16)
    err = value - near.float()
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float16)
    other = torch.nextafter(near, toward)
    gap = other.float() - near.float()
    prob = torch.where(gap != 0, err / gap, torch.zeros_like(err))  # in [0, 0.5]
    draw = torch.rand(value.shape, device=value.device, generator=generator)
    result = torch.where(draw < prob, other, near)
    return result if out is None else out.copy_(result)
