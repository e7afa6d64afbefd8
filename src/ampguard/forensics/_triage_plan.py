"""Which failed steps ``ampguard.triage`` replays, and what it replays each from.

The failed steps: the recorder's NaN/inf steps, the flight recorder's non-finite and spiking
windows (and, under DDP, the union over the ranks); each step's record (the recorder's
signatures, or, for a step its sampling left out, the flight recorder's loss); and its plan
(``loss_fn``, batch, the restore of the state it started from).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ampguard.forensics._signatures import SignatureRecorder, StepSignature

__all__ = ["agreed", "failed", "plan", "signature"]


def failed(recorder: SignatureRecorder, watch: Any) -> list[int]:
    failed = set(recorder.bad_steps())
    if watch is not None and getattr(watch, "ring", None) is not None:
        for row in watch.ring.rows():  # window n is the step whose forward saw steps == n - 1
            if row.get("loss") is None or row.get("spike"):
                failed.add(int(row["step"]) - 1)
    return sorted(s for s in failed if signature(recorder, watch, s) is not None)


def signature(recorder: SignatureRecorder, watch: Any, step: int) -> StepSignature | None:
    """``step``'s record: the recorder's, or, for a step its sampling left out, the flight
    recorder's loss (when the ring and the recorder's RNG state still hold it); else None.
    Cost: a host sync."""
    if step in recorder.steps:
        return recorder.read(step)
    ring = getattr(watch, "ring", None) if watch is not None else None
    if ring is None:
        return None
    try:
        recorder.rng_state(step)
    except KeyError:
        return None
    for row in ring.rows():
        if int(row["step"]) - 1 == step:
            return StepSignature(
                step, {}, {}, {}, row.get("loss") is None, complete=False, loss=row.get("loss")
            )
    return None


def agreed(steps: list[int]) -> list[int]:
    """Under ``torch.distributed``: the union of the ranks' failed steps (one collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return steps
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, steps)
    return sorted({s for r in rows for s in r})


def plan(
    guard: Any,
    watch: Any,
    recorder: SignatureRecorder,
    step: int,
    loss_fn: Any,
    batch: Any,
    restore: Callable[[int], None] | None,
    single: bool,
) -> tuple[Any, Any, Callable[[int], None] | None] | None:
    """``(loss_fn, batch, restore)`` for replaying ``step``; None (or, for ``step=``, an
    error naming what is missing) when it cannot be replayed."""
    recorded = _recorded(watch, step)
    if batch is None and recorded is not None:
        batch, loss_fn = recorded[0], loss_fn or recorded[1]
    elif batch is not None and step != max(recorder.steps) and recorded is None:
        batch = None  # batch= is the latest step's
    missing = None
    if batch is None:
        missing = (
            f"the batch of step {step}: pass guard.step(batch=..., loss_fn=...) so the flight "
            "recorder keeps it, or batch= for the latest step"
        )
    elif loss_fn is None or not callable(loss_fn):
        missing = "loss_fn=: loss_fn(model, batch) -> the scalar loss"
    if restore is None and missing is None:
        snaps = getattr(watch, "snapshots", None) if watch is not None else None
        snap = snaps.before(step + 1) if snaps is not None else None
        if snap is not None and snap.step == step:
            state = snap.loaded().model

            def restore(_s: int, state: Any = state) -> None:
                guard.model.load_state_dict(state)

        elif step != guard.steps - 1:
            missing = (
                f"the state step {step} started from: Guard(snapshot_every=1) keeps it, or pass "
                "restore=(a function restoring your snapshot)"
            )
    if missing is None:
        return loss_fn, batch, restore
    if single:
        raise ValueError(f"ag.triage cannot replay step {step}: it needs {missing}")
    return None


def _recorded(watch: Any, step: int) -> tuple[Any, Any] | None:
    """``step``'s ``(batch, loss_fn)`` as the flight recorder keeps it: one pair (attach mode)
    or the window's micro-batches' pairs, of which triage replays a window of one (a window
    accumulated over several is not one forward+backward: None)."""
    kept = getattr(watch, "batches", {}).get(step + 1) if watch is not None else None
    if isinstance(kept, list):
        return tuple(kept[0]) if len(kept) == 1 else None
    return kept
