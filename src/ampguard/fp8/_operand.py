"""One traced tensor as the plan measures it: converted to float32 once, with the statistics
every format shares.

The plan measures each Linear's input, weight and output gradient in up to four formats and
two fp8 recipes. What does not depend on the format (the float32 values, their magnitudes, the
nonzero count, the power, the amax per tensor, per row and per block, the median magnitude) is
computed once here, lazily, and read by every format (:mod:`ampguard.fp8._quant`,
:mod:`ampguard.fp8._multi`). Cost: no host sync; each statistic is one pass over the tensor the
first time it is read.

Sampling: the plan measures :func:`sample_size` evenly spaced rows of each tensor (the first row
always, the same rows for every format): at least ``MIN_ROWS`` (128) rows and at least
``MIN_VALUES`` (2**15) values, so a narrow tensor (a 32-feature input, a 16-output gradient)
gives more rows. Every figure is a share or a power ratio over those values: the binomial
standard error of a 1% share over 2**15 values is 0.06 percentage point. On the planted models
of the tests the sampled figures stay within 0.3 dB and 0.3 percentage point of the figures over
every row, with the same verdicts (``test_sampled_figures_match_the_full_tensors`` checks 0.5 dB
and 0.5 point on a 1024-sample batch). A planted outlier feature (a column) is in every sampled
row; an outlier row is measured when it is sampled (row 0 always is).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["Operand", "sample_rows", "sample_size", "nonzero_count", "MIN_ROWS", "MIN_VALUES"]

MIN_ROWS = 128  # rows of each input, weight and gradient measured (evenly spaced), at least
MIN_VALUES = 1 << 15  # ... and enough rows for this many values (narrow tensors: more rows)


def sample_size(rows: int, width: int) -> int:
    """How many of ``rows`` rows of ``width`` values the plan measures: at least
    :data:`MIN_ROWS` and at least :data:`MIN_VALUES` values, or all of them."""
    return min(rows, max(MIN_ROWS, -(-MIN_VALUES // max(width, 1))))


def sample_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`sample_size` evenly spaced rows (the first always) of ``t`` seen as
    ``(-1, width)``, in bf16 (what the casts see). No host sync."""
    flat = t.detach().reshape(-1, width)
    step = -(-flat.shape[0] // sample_size(flat.shape[0], width))
    return flat[::step].to(torch.bfloat16)


def nonzero_count(t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The count of ``t``'s nonzero values as a 0-d float32 (``sign(t) . sign(t)``: a fifth
    of ``count_nonzero``'s time on a CPU; exact below 2**24 values). ``buf``: scratch, t's
    shape. No host sync."""
    s = torch.sign(t, out=buf).reshape(-1)
    return torch.dot(s, s)


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

    def scratch(self, i: int) -> torch.Tensor:
        """Float32 buffer ``i`` (0 or 1) of the tensor's shape, shared by every cast of this
        operand (a cast's result lives in buffer 0 until the next cast: no allocation)."""
        key = f"_scratch{i}"
        if key not in self.__dict__:
            self.__dict__[key] = torch.empty_like(self.x)
        buf: torch.Tensor = self.__dict__[key]
        return buf

    @functools.cached_property
    def nonzero(self) -> torch.Tensor:
        """The count of nonzero values (0-d float32)."""
        return nonzero_count(self.x, self.scratch(1))

    @functools.cached_property
    def power(self) -> torch.Tensor:
        """``sum(x ** 2)`` (0-d float32)."""
        flat = self.x.reshape(-1)
        return torch.dot(flat, flat)

    @functools.cached_property
    def row_amax(self) -> torch.Tensor:
        """The amax of each row, shape (rows, 1)."""
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
            return nz.median() if nz.numel() else self.x.new_full((), float("nan"))
        codes = self.source.abs().contiguous().view(torch.int16).reshape(-1)
        counts = torch.bincount(codes.long(), minlength=1 << 15)
        counts[0] = 0  # zeros (abs turns -0 into +0) are not counted
        cum = counts.cumsum(0)
        k = cum[-1]
        idx = torch.searchsorted(cum, (k + 1) // 2)  # the value of rank (k - 1) // 2
        value = idx.clamp(max=(1 << 15) - 1).to(torch.int16).view(torch.bfloat16).float()
        return torch.where(k > 0, value, torch.nan)
