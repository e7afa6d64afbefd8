"""The Guard's step flags once on the host: count them, and act on a collapse.

A window whose optimizers all step in Python reads its packed flags at once (the step's one host
sync) and :func:`settle` acts on them. Fused optimizers skip themselves on the device, so their
flags stay pending (``StepState.pending``) until something reads them (``StepResult.applied``,
``guard.scale``, ``diagnostics()``, a checkpoint, at the latest every 100 windows); :func:`drain`
then decodes them all with one host sync and acts on them in order.
"""

from __future__ import annotations

import torch

from ampguard.core import results
from ampguard.guard import _collapse, _nonfinite, _spikes
from ampguard.guard._step_state import StepState

__all__ = ["DRAIN_EVERY", "drain", "settle"]

DRAIN_EVERY = 100  # fused optimizers: settle pending step flags at least this often


def drain(state: StepState, act: bool = True) -> None:
    """Decode pending fused-step flags; unless ``act`` is False (a load replaces what they
    would count), also count them and act on a collapse. Cost: one host sync for all."""
    if not state.pending:
        return
    pending, state.pending = state.pending, []
    values = torch.stack([status for _, status in pending]).tolist()
    collapsed, scaled, settled = [], state.scaled, []
    for (result, _), value in zip(pending, values, strict=True):
        flags = result.settle(results.decode(int(value), len(state.optimizers), scaled))
        if not act:
            continue
        settled.append((result.step, flags))
        _record(state, result.step, flags)  # count every step before any raise
        bound = _nonfinite.over_bound(state)  # no scale: too many non-finite skips in a row
        if (flags.collapse or bound) and state.config.on_collapse == "warn":
            _collapse.on_collapse(state, result.step)  # in order: an applied step ends an episode
        elif flags.collapse or bound:  # the count as it was at that step, for the message
            collapsed.append((result.step, state.counts.consecutive_nonfinite))
    if collapsed:
        step, run = collapsed[0]
        _collapse.on_collapse(state, step, run)
        if scaled and not state.scaled:  # a fallback read late: its windows count
            _nonfinite.after_late_fallback(state, [sf for sf in settled if sf[0] > step])


def settle(state: StepState, step: int, flags: results.Decoded) -> None:
    """Count window ``step``'s flags (read on the host) and act on a collapse."""
    _record(state, step, flags)
    if flags.collapse or _nonfinite.over_bound(state):
        _collapse.on_collapse(state, step)


def _record(state: StepState, step: int, flags: results.Decoded) -> None:
    if state.forensics is not None:
        state.forensics.on_settled(step, flags.overflow or flags.nonfinite, flags.applied)
    state.counts.record(flags)
    if flags.applied:
        state.collapsing = False
    if state.spikes is not None:
        scale = _spikes.scale_state(state)  # the scale and its trackers, for a rewind
        if flags.spike:  # warn, rewind or raise (ampguard.guard._spikes)
            other = "fp16 overflow" if flags.overflow else "non-finite" if flags.nonfinite else None
            state.spikes.on_spike(step, scale, skipped_for=other and f"{other} gradients")
        elif (flags.nonfinite or flags.loss_nonfinite) and state.spikes.dumper is not None:
            state.spikes.dumper.dump("nonfinite", step)
