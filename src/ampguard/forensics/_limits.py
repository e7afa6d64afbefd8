"""The precision facts :func:`ampguard.forensics.locate` reads, derived from the registry.

A low precision's range limits are those of its ``low_dtype`` (fp16's largest finite value and
smallest normal, bf16's); the full precision (autocast off) is the reference every replay is
compared with; what locate accepts are the low precisions: autocast alone reproduces fp16 and
bf16, and the low-precision formats (fp8, MXFP8, NVFP4, block-wise fp8) are replayed with their
Linear layers emulated (:mod:`ampguard.forensics._lowp`).
"""

from __future__ import annotations

import torch

from ampguard.core.policy import dtype_of
from ampguard.precisions import AUTO, REGISTRY

__all__ = ["FULL", "LOW_DTYPES", "MAX", "REPLAYABLE", "TINY"]


def _finfo(attribute: str) -> dict[str, float]:
    out = {}
    for name, entry in REGISTRY.items():
        dtype = dtype_of(entry.low_dtype)
        if dtype is not None:
            out[name] = float(getattr(torch.finfo(dtype), attribute))
    return out


MAX = _finfo("max")
"""Precision name -> the largest finite value of its low dtype."""
TINY = _finfo("tiny")
"""Precision name -> the smallest normal value of its low dtype."""
LOW_DTYPES = tuple(
    {dtype_of(entry.low_dtype): None for entry in REGISTRY.values() if entry.low_dtype}
)
"""The distinct low dtypes (fp16, bf16): a backward value in one of them is range limited."""
FULL = next(name for name, entry in REGISTRY.items() if entry.is_full)
"""The full precision (fp32): the reference run."""
REPLAYABLE = (*(n for n, e in REGISTRY.items() if e.low_dtype is not None), AUTO)
"""What ``locate(precision=)`` accepts."""
