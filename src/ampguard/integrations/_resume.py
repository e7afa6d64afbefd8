"""A resume keeps attach mode's spike statistics: ``Watch.state_dict()`` / ``load_state_dict()``.

The Guard saves its spike detector's statistic in ``Guard.state_dict()["spikes"]``
(:meth:`ampguard.replay.SpikeDetector.state_dict`); an attached run saves the same with its
step count, so a run resumed from a checkpoint judges its next loss against the statistic the
interrupted run had (no fresh warm-up) and numbers its steps on: it flags the same spike at the
same step as the uninterrupted run. The plain loop saves ``handle.state_dict()`` with its
checkpoint and calls ``handle.load_state_dict(...)`` before its first step after the resume;
the HF Trainer callback writes it into each checkpoint folder and Lightning's keeps it in the
checkpoint's callback state, and both load it on resume themselves.
"""

from __future__ import annotations

from typing import Any

from ampguard.replay import SpikeDetector

__all__ = ["STATE_VERSION", "ResumeSurface", "check_state"]

STATE_VERSION = 1


def check_state(state: Any) -> dict[str, Any]:
    """``state`` as :meth:`ResumeSurface.load_state_dict` takes it; ``ValueError`` naming the
    bad field (nothing is changed)."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(
            "state must be a dict from Watch.state_dict() (version "
            f"{STATE_VERSION}), got {state!r:.80}"
        )
    steps = state.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"malformed watch state: 'steps' must be an int >= 0, got {steps!r}")
    if state.get("spikes") is not None:
        SpikeDetector.check_state(state["spikes"])
    return state


class ResumeSurface:
    """``state_dict()`` / ``load_state_dict()`` of a Watch (a mixin: it reads the Watch's own
    state)."""

    recorder: Any
    _done: int
    _signatures: Any

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the steps seen and the spike detector's statistic (None
        without a recorder). JSON-serialisable. Cost: one host sync."""
        spikes = None if self.recorder is None else self.recorder.spikes.detector.state_dict()
        return {"version": STATE_VERSION, "steps": self._done, "spikes": spikes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back :meth:`state_dict` output, before this Watch's first step: the step count
        goes on from the saved one and the detector keeps the saved statistic. ``ValueError``
        for a malformed state or a Watch that has already seen a step (nothing changes then).
        Cost: one host-to-device copy."""
        state = check_state(state)
        if self._done:
            raise ValueError(
                f"load_state_dict must come before the first step: this watch has seen "
                f"{self._done}; attach a new one for the resumed run"
            )
        self._done = state["steps"]
        if self._signatures is not None:  # the window that begins now, by the restored count
            self._signatures.window(self._done)
        if self.recorder is not None and state.get("spikes") is not None:
            self.recorder.spikes.detector.load_state_dict(state["spikes"])
