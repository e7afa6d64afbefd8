"""``Guard(signatures=...)``: the sync-free signatures ``ampguard.triage`` compares replays with.

``True`` records one window in :data:`DEFAULT_EVERY` (what keeps a launch-bound step within
2% of its time; the other windows are still triaged, compared on the loss alone), an int
``N`` one window in ``N`` (``1``: every window, every module localised); the recorder
(:class:`ampguard.forensics.SignatureRecorder`) hooks the model (the module inside a DDP
wrapper, so its replays run no collective) and numbers windows by ``guard.steps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampguard.findings import Finding
from ampguard.forensics import SignatureRecorder

__all__ = ["DEFAULT_EVERY", "attach", "check", "findings"]

DEFAULT_EVERY = 32  # benchmarks/fault_zoo.py: 1.36x on a 0.5 ms CPU step when every window


def check(signatures: Any) -> int | None:
    """One window in how many is recorded (None: off). ``ValueError`` naming the argument."""
    if signatures is False or signatures is None:
        return None
    if signatures is True:
        return DEFAULT_EVERY
    if isinstance(signatures, int) and not isinstance(signatures, bool) and signatures >= 1:
        return signatures
    raise ValueError(
        "signatures must be True (one window in 32), False, or a positive int N (one window in "
        "N; 1: every window), "
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


def findings(recorder: SignatureRecorder | None) -> list[Finding]:
    """The AG380-AG383 findings of the steps ``ampguard.triage`` decided with ``recorder``
    (in step order). Cost: none."""
    if recorder is None:
        return []
    return [recorder.events[s].finding() for s in sorted(recorder.events)]
