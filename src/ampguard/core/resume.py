"""A safe landing after a resume: ramp the learning rate back up while the loss scale settles.

After a resume whose loss scale differs a lot from the scale before the interruption, or was reset
(a checkpoint without scaler state), the first few hundred steps probe the scale again. The usual
advice is a lower learning rate until it settles; :class:`ResumeWarmup` does it for you.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ampguard._util.checks import check_int

__all__ = ["ResumeWarmup", "ResumeTracker", "WarmupRamp", "scale_gap_bits"]


@dataclass(frozen=True)
class ResumeWarmup:
    """Multiply every LR by a factor ramping linearly from ``lr_factor`` to 1 over ``steps``.

    Applies only when the resume check fires: the scale was reset, or differs from the scale
    before the interruption by at least ``2**min_gap_bits``. The LR the user's scheduler set is
    restored right after each optimizer step, so schedulers never see the factor and the LRs
    return bitwise to the scheduler's values when the ramp ends.
    """

    steps: int = 200
    lr_factor: float = 0.1
    min_gap_bits: int = 4

    def __post_init__(self) -> None:
        check_int("ResumeWarmup.steps", self.steps)
        if not (isinstance(self.lr_factor, (int, float)) and 0 < self.lr_factor <= 1):
            raise ValueError(f"ResumeWarmup.lr_factor must be in (0, 1], got {self.lr_factor!r}")
        check_int("ResumeWarmup.min_gap_bits", self.min_gap_bits)

    def triggered(self, scale_reset: bool, gap_bits: float | None) -> bool:
        """Whether a resume with this scale reset / gap (in powers of two) warrants the ramp."""
        return scale_reset or (gap_bits is not None and gap_bits >= self.min_gap_bits)


def scale_gap_bits(before: float | None, after: float | None) -> float | None:
    """``|log2(after / before)|``, or None when either scale is unknown or not positive."""
    if not before or not after or before <= 0 or after <= 0:
        return None
    return abs(math.log2(after / before))


class WarmupRamp:
    """The running ramp: scales param-group LRs around each optimizer step. No host sync."""

    def __init__(self, config: ResumeWarmup, start_step: int) -> None:
        self.config = config
        self.start_step = start_step
        self._saved: list[tuple[dict[str, Any], Any]] = []

    def factor(self, step: int) -> float:
        """The LR multiplier at window ``step`` (1.0 once the ramp is over)."""
        t = step - self.start_step - 1  # the first window after the resume gets lr_factor
        if t >= self.config.steps:
            return 1.0
        f = self.config.lr_factor
        return f + (1.0 - f) * max(t, 0) / self.config.steps

    def done(self, step: int) -> bool:
        return step - self.start_step >= self.config.steps

    def apply(self, optimizers: Sequence[torch.optim.Optimizer], step: int) -> None:
        """Multiply every group's LR by the factor, remembering the scheduler's value."""
        factor = self.factor(step)
        self._saved = [(g, g["lr"]) for opt in optimizers for g in opt.param_groups]
        for group, lr in self._saved:
            group["lr"] = lr * factor

    def restore(self) -> None:
        """Put back exactly the LR objects the scheduler had set."""
        for group, lr in self._saved:
            group["lr"] = lr
        self._saved = []


class ResumeTracker:
    """What the Guard knows about the last resume, and the warm-up ramp it may have started."""

    def __init__(self, config: ResumeWarmup | None) -> None:
        if config is not None and not isinstance(config, ResumeWarmup):
            raise TypeError(
                "resume_warmup must be an ampguard.ResumeWarmup or None, got "
                f"{type(config).__name__}"
            )
        self.config = config
        self.info: dict[str, Any] | None = None
        self.ramp: WarmupRamp | None = None

    def mark(self, step: int, *, scale_reset: bool, saved_scale: float | None) -> None:
        """Record a resume at window ``step``; a reset scale starts the ramp at once."""
        self.info = {
            "step": step,
            "scale_reset": scale_reset,
            "saved_scale": saved_scale,
            "gap_bits": None,
            "warmup": False,
        }
        self._maybe_start(step)

    def check(self, step: int, previous_scale: float, current_scale: float | None) -> float | None:
        """Record the gap to the pre-interruption scale; start the ramp when it is large."""
        if self.info is None:
            self.mark(step, scale_reset=False, saved_scale=None)
        assert self.info is not None
        gap = scale_gap_bits(previous_scale, current_scale)
        self.info["previous_scale"] = float(previous_scale)
        self.info["gap_bits"] = gap
        self._maybe_start(step)
        return gap

    def state_dict(self) -> dict[str, Any]:
        """Where a running ramp started (the resume record itself belongs to this process)."""
        return {"ramp_start": self.ramp.start_step if self.ramp is not None else None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue a ramp that was running when the state was saved (unless one just started)."""
        if (
            not state
            or state.get("ramp_start") is None
            or self.config is None
            or self.ramp is not None
        ):
            return
        self.ramp = WarmupRamp(self.config, int(state["ramp_start"]))
        if self.info is not None:
            self.info["warmup"] = True

    def before_step(self, optimizers: Sequence[torch.optim.Optimizer], step: int) -> None:
        if self.ramp is not None:
            self.ramp.apply(optimizers, step)

    def after_step(self, step: int) -> None:
        if self.ramp is None:
            return
        self.ramp.restore()
        if self.ramp.done(step):
            self.ramp = None

    def _maybe_start(self, step: int) -> None:
        cfg, info = self.config, self.info
        if cfg is None or info is None or info["warmup"]:
            return
        if cfg.triggered(info["scale_reset"], info["gap_bits"]):
            self.ramp = WarmupRamp(cfg, step)
            info["warmup"] = True
