"""``Guard(signatures=...)``: the sync-free signatures ``ampguard.triage`` compares replays with.

``True`` records one window in :data:`DEFAULT_EVERY` (what keeps a launch-bound step within
2% of its time; the other windows are still triaged, compared on the loss alone), an int
``N`` one window in ``N`` (``1``: every window, every module localised); the recorder
(:class:`ampguard.forensics.SignatureRecorder`) hooks the model (the module inside a DDP
wrapper, so its replays run no collective) and numbers windows by ``guard.steps``. The Guard
drives it (:func:`window`, as each window begins): a window it does not record runs none of
its hooks (with a flight recorder, one pre-hook keeping the window's RNG state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampguard.findings import Finding
from ampguard.forensics import SignatureRecorder

__all__ = ["DEFAULT_EVERY", "attach", "check", "findings", "window"]

DEFAULT_EVERY = 32  # benchmarks/bench_signatures.py: every window 1.31x on a 1.3 ms CPU step


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
    model: torch.nn.Module, every: int | None, clock: Callable[[], int], losses: bool = True
) -> SignatureRecorder | None:
    """The recorder on ``model`` (its ``.module`` under DDP), or None when off; driven by the
    owner (``SignatureRecorder.window``, called here for the first window and by the owner as
    each later one begins), so that a window it does not record runs no hook, unless
    ``losses`` (a flight recorder keeps those windows' losses, which triage compares a replay
    with): then one pre-hook keeps their RNG state."""
    if every is None:
        return None
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    recorder = SignatureRecorder(inner, every=every, clock=clock, unrecorded_rng=losses)
    recorder.window(clock())
    return recorder


def window(recorder: SignatureRecorder | None, step: int) -> None:
    """Window ``step`` begins (``SignatureRecorder.window``). Cost: an integer compare."""
    if recorder is not None:
        recorder.window(step)


def findings(recorder: SignatureRecorder | None) -> list[Finding]:
    """The AG380-AG383 findings of the steps ``ampguard.triage`` decided with ``recorder``
    (in step order). Cost: none."""
    if recorder is None:
        return []
    return [recorder.events[s].finding() for s in sorted(recorder.events)]
