"""Range statistics on the device: per layer, the largest |gradient| and a histogram of the
base-2 exponents of the gradients, from the fp32 bits of the flattened gradients.

Telemetry takes one sample every ``range_every`` steps; the host turns the histogram into
headroom, underflow and the safe scale window (:func:`ampguard.rules.summarize_ranges`). The
gradients are flattened in chunks of at most :data:`CHUNK` elements (planned once, at attach),
so a sample is a fixed number of ops per chunk whatever the number of parameter tensors.
"""

from __future__ import annotations

import torch

from ampguard.rules import RANGE_BINS, RANGE_E_MIN
from ampguard.telemetry import _layers

__all__ = ["CHUNK", "RangeSampler", "range_keys"]

CHUNK = 1 << 20  # a sample flattens at most this many gradient elements at once


class RangeSampler:
    """The chunk plan of one model's parameters and the sampling ops over it.

    Cost of :meth:`sample`: about 15 device ops per chunk (a concatenation, then mostly integer
    ops on the fp32 bits), no host sync.
    """

    def __init__(self, layout: _layers.Layout, device: torch.device) -> None:
        self._chunks = _layers.plan_chunks(layout, device, CHUNK)
        # histogram row start of each chunk item (int32: the histogram keys are int32)
        self._offsets = [(ch.layer * RANGE_BINS).to(torch.int32) for ch in self._chunks]
        self._sizes = [[b - a for _, a, b in ch.items] for ch in self._chunks]
        self._one = torch.ones(1, dtype=torch.float32, device=device)

    def sample(
        self,
        grads: list[torch.Tensor],
        amax: torch.Tensor,
        hist: torch.Tensor,
        inv_scale: torch.Tensor | None,
    ) -> None:
        """Raise ``amax`` (per layer) to the largest |gradient| and add every gradient to its
        layer's exponent bin in ``hist`` (layers x BINS, flat); ``inv_scale`` unscales
        gradients that still carry the loss scale. Both start at zero for a new sample."""
        for ch, offsets, sizes in zip(self._chunks, self._offsets, self._sizes, strict=True):
            flat = torch.cat(
                [  # most items are whole tensors: no slice
                    grads[i].reshape(-1) if b - a == grads[i].numel() else grads[i].reshape(-1)[a:b]
                    for i, a, b in ch.items
                ]
            )
            if flat.dtype != torch.float32:
                flat = flat.float()
            if inv_scale is not None:
                flat.mul_(inv_scale)
            # fp32 bits with the sign cleared: as a float that is |g| (NaN stays NaN); as an
            # integer its top bits are the biased exponent, which is all the histogram needs
            # (integer ops, several times cheaper than frexp on the CPU).
            bits = flat.view(torch.int32).bitwise_and_(0x7FFFFFFF)
            peaks = torch.stack(torch._foreach_max(bits.view(torch.float32).split(sizes)))
            amax.scatter_reduce_(0, ch.layer, peaks, "amax")
            keys = range_keys(bits, offsets, ch)
            if keys.device.type == "cpu":  # a counting pass, ~7x faster than index_add_ here
                hist.add_(torch.bincount(keys, minlength=hist.numel()))
            else:  # CUDA's bincount syncs the host (it sizes its output); index_add_ does not
                hist.index_add_(0, keys, self._one.expand(ch.total))


def range_keys(bits: torch.Tensor, offsets: torch.Tensor, ch: _layers.Chunk) -> torch.Tensor:
    """Histogram cell of every value from its fp32 bits with the sign cleared (int32).

    floor(log2|g|) = biased exponent - 127 for normal numbers. Bin 0: exact zero; bin k:
    floor(log2|g|) == E_MIN + k - 1, clamped into [1, BINS - 1] (fp32 subnormals land in bin
    1 like every value below 2**E_MIN; inf and NaN, an overflowing step whose sample the
    rules and the report skip, in the top bin). ``min(key, bits)`` is 0 only for an exact zero:
    any nonzero value has bits >= 1, and a key above 1 needs bits far above BINS.
    """
    key = bits.bitwise_right_shift(23).sub_(126 + RANGE_E_MIN).clamp_(1, RANGE_BINS - 1)
    torch.minimum(key, bits, out=key)
    return key.add_(torch.repeat_interleave(offsets, ch.lengths, output_size=ch.total))
