"""The parameters' checksum the audit compares across ranks (re-exported by
:mod:`ampguard.distributed`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["param_checksum"]


def param_checksum(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Exact, order-independent checksum of the parameters' bits (0-dim int64 on their device).

    Each tensor's bits are summed as integers (no rounding, so equal parameters give equal sums
    whatever the reduction order) and weighted by the tensor's position. Cost: one read of the
    parameters; no host sync.
    """
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
    total = None
    for i, p in enumerate(params):
        t = p.detach()
        if not t.is_floating_point():
            continue
        s = t.contiguous().view(ints[t.element_size()]).sum(dtype=torch.int64) * (2 * i + 1)
        total = s if total is None else total + s
    if total is None:
        return torch.zeros((), dtype=torch.int64)
    return total
