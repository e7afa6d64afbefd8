"""``Guard(signatures=...)``: the sync-free signatures ``ampguard.triage`` compares replays with.

``True`` records every window, an int ``N`` one window in ``N``; the recorder
(:class:`ampguard.forensics.SignatureRecorder`) hooks the model (the module inside a DDP
wrapper, so its replays run no collective) and numbers windows by ``guard.steps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampguard.forensics import SignatureRecorder

__all__ = ["attach", "check"]


def check(signatures: Any) -> int | None:
    """One window in how many is recorded (None: off). ``ValueError`` naming the argument."""
    if signatures is False or signatures is None:
        return None
    if signatures is True:
        return 1
    if isinstance(signatures, int) and not isinstance(signatures, bool) and signatures >= 1:
        return signatures
    raise ValueError(
        "signatures must be True (every window), False, or a positive int N (one window in N), "
        f"got {signatures!r}"
    )


def attach(
    model: torch.nn.Module, every: int | None, clock: Callable[[], int]
) -> SignatureRecorder | None:
    """The recorder on ``model`` (its ``.module`` under DDP), or None when off."""
    if every is None:
        return None
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return SignatureRecorder(inner, every=every, clock=clock)
