"""One traced tensor as the plan measures it: converted to float32 once, with the statistics
every format shares.

The plan measures each Linear's input, weight and output gradient in up to four formats and
two fp8 recipes. What does not depend on the format (the float32 values, their magnitudes, the
nonzero count, the power, the amax per tensor, per row and per block, the median magnitude) is
computed once here, lazily, and read by every format (:mod:`ampguard.fp8._quant`,
:mod:`ampguard.fp8._multi`). Cost: no host sync; each statistic is one pass over the tensor the
first time it is read.

Sampling: the plan measures at most ``MAX_ROWS`` (256) rows of each tensor, evenly spaced and the
same rows for every format (:func:`sample_rows`): every figure is a share or a power ratio over
at least 256 x in_features values, so the sampled figures stay within about 0.1 dB and 0.1
percentage point of the full tensor's on the layers of the tests (``test_sampled_figures_match``
in ``tests/test_lowp_plan.py``); a planted outlier row or feature is measured as long as it is
one of the sampled rows (row 0 always is) or a column (every sampled row holds it).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["Operand", "sample_rows", "MAX_ROWS"]

MAX_ROWS = 256  # rows of each input, weight and gradient measured, evenly spaced


def sample_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """At most :data:`MAX_ROWS` evenly spaced rows (the first always) of ``t`` seen as
    ``(-1, width)``, in bf16 (what the casts see). No host sync."""
    flat = t.detach().reshape(-1, width)
    step = -(-flat.shape[0] // MAX_ROWS)
    return flat[::step].to(torch.bfloat16)


class Operand:
    """A 2-D tensor (rows, width) with its shared statistics, each computed on first use."""

    def __init__(self, t: torch.Tensor) -> None:
        self.source = t
        self.x = t.float().contiguous()  # the values every format quantises
        self.rows, self.width = self.x.shape

    @functools.cached_property
    def abs(self) -> torch.Tensor:
        """``|x|``."""
        return self.x.abs()

    @functools.cached_property
    def nonzero(self) -> torch.Tensor:
        """The count of nonzero values (0-d float32)."""
        return torch.count_nonzero(self.x).float()

    @functools.cached_property
    def power(self) -> torch.Tensor:
        """``sum(x ** 2)`` (0-d float32)."""
        flat = self.x.reshape(-1)
        return torch.dot(flat, flat)

    @functools.cached_property
    def row_amax(self) -> torch.Tensor:
        """The amax of each row, shape (rows, 1)."""
        if self.width % 16 == 0 and "_blocks16" in self.__dict__:
            return self.block_amax(16).amax(dim=-1, keepdim=True)
        return self.abs.amax(dim=-1, keepdim=True)

    @functools.cached_property
    def amax(self) -> torch.Tensor:
        """The amax of the tensor (0-d)."""
        return self.row_amax.amax()

    def block_amax(self, block: int) -> torch.Tensor:
        """The amax of each block of ``block`` consecutive values of a row, (rows, width/block);
        ``block`` is 16 or a multiple of it, dividing the width."""
        if "_blocks16" not in self.__dict__:
            self.__dict__["_blocks16"] = self.abs.view(self.rows, -1, 16).amax(dim=-1)
        b16: torch.Tensor = self.__dict__["_blocks16"]
        if block == 16:
            return b16
        return b16.view(self.rows, -1, block // 16).amax(dim=-1)

    @functools.cached_property
    def median_nonzero(self) -> torch.Tensor:
        """The (lower) median of the nonzero magnitudes (0-d float32; NaN when all are zero).

        For bf16 values a histogram of their bit patterns (nonnegative bf16 values sort as their
        int16 codes): exact, and one pass instead of a selection."""
        if self.source.dtype != torch.bfloat16:
            nz = self.abs[self.abs > 0]
            return nz.median() if nz.numel() else torch.tensor(float("nan"))
        codes = self.source.abs().contiguous().view(torch.int16).reshape(-1)
        counts = torch.bincount(codes.long(), minlength=1 << 15)
        counts[0] = 0  # zeros (abs turns -0 into +0) are not counted
        cum = counts.cumsum(0)
        k = cum[-1]
        idx = torch.searchsorted(cum, (k + 1) // 2)  # the value of rank (k - 1) // 2
        value = idx.clamp(max=(1 << 15) - 1).to(torch.int16).view(torch.bfloat16).float()
        return torch.where(k > 0, value, torch.nan)
