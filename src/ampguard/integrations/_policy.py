"""Attach-mode guard features: floor, cap and hysteresis applied through ``GradScaler.update``.

The user's ``torch.amp.GradScaler`` runs its own update first; :class:`AttachPolicy` then corrects
the scale tensor in place, on the device:

    prev = scale before torch's update;  found = any non-finite gradient this step
    torch's update                        # scale *= backoff on overflow, *= growth after interval
    if hysteresis > 1:
        budget = max(budget - found, 0)
        if found and budget > 0:          # overflow absorbed: the step is still skipped,
            scale = prev                  # but the scale does not back off
        if not found and (consecutive_hysteresis or the scale just grew):
            budget = hysteresis
    collapse = found and budget == 0 and prev <= min_scale
    scale = clamp(scale, min_scale, max_scale)

With ``min_scale=None``, ``max_scale=None`` and ``hysteresis=1`` nothing is changed at all. Inside
``[min_scale, max_scale]`` and without hysteresis the scale is torch's, bit for bit: the policy only
acts in the regime where torch's own scale would be pathological (falling below ``min_scale``,
growing past ``max_scale``, or halving on a single spike). This is the same algorithm as
:class:`ampguard.LossScaler`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ampguard._util.checks import is_int, is_number

__all__ = ["AttachPolicy", "PolicyState", "COLLAPSE_POLICIES", "grad_scaler", "guard_options"]

COLLAPSE_POLICIES = ("warn", "raise")


@dataclass(frozen=True)
class AttachPolicy:
    """Floor, cap and hysteresis for a scaler that ampguard does not own.

    ``on_collapse`` says what happens on an overflow while the scale is already at ``min_scale``:
    ``"warn"`` warns once per collapse episode, ``"raise"`` raises
    :class:`ampguard.ScaleCollapseError`; both happen when the step flags are read (every flush),
    not inside the step, so that attach mode adds no host sync.
    """

    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    on_collapse: str = "warn"

    def __post_init__(self) -> None:
        lo, hi = self.min_scale, self.max_scale
        if lo is not None:
            _check(
                is_number(lo) and math.isfinite(lo) and lo > 0,
                "min_scale",
                "must be None or a finite number > 0",
                lo,
            )
        if hi is not None:
            _check(
                is_number(hi) and math.isfinite(hi) and hi > 0,
                "max_scale",
                "must be None or a finite number > 0",
                hi,
            )
        if lo is not None and hi is not None:
            _check(hi >= lo, "max_scale", f"must be >= min_scale ({lo})", hi)
        _check(
            is_int(self.hysteresis) and self.hysteresis >= 1,
            "hysteresis",
            "must be an integer >= 1",
            self.hysteresis,
        )
        _check(
            isinstance(self.consecutive_hysteresis, bool),
            "consecutive_hysteresis",
            "must be a bool",
            self.consecutive_hysteresis,
        )
        _check(
            self.on_collapse in COLLAPSE_POLICIES,
            "on_collapse",
            f"must be one of {COLLAPSE_POLICIES}",
            self.on_collapse,
        )

    @property
    def active(self) -> bool:
        """True when the policy can change the scale (otherwise attach mode only observes)."""
        return self.min_scale is not None or self.max_scale is not None or self.hysteresis > 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "on_collapse": self.on_collapse,
        }


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"watch(): {name} {rule}, got {value!r}")


class PolicyState:
    """Device state of an :class:`AttachPolicy` bound to one scaler (the hysteresis budget)."""

    def __init__(self, policy: AttachPolicy) -> None:
        self.policy = policy
        self._budget: torch.Tensor | None = None

    def apply(
        self, scale: torch.Tensor, tracker: torch.Tensor, prev: torch.Tensor, found: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Correct ``scale`` in place after torch's update; return ``(collapse, kinds)``.

        ``scale``/``tracker`` are the scaler's own tensors, ``prev`` the scale before the update,
        ``found`` the combined non-finite flag torch used. ``collapse`` is a 0-dim bool tensor;
        ``kinds`` a bool tensor ``[absorbed by hysteresis, raised to the floor, held at the cap]``
        saying how this step's scale differs from torch's. Cost: no host sync (a handful of
        0-dim device ops).
        """
        pol = self.policy
        is_found = found.to(scale.device) > 0
        backoff = is_found
        no = torch.zeros((), dtype=torch.bool, device=scale.device)
        absorbed = no
        if pol.hysteresis > 1:
            budget = self._budget_on(scale.device)
            budget.sub_(is_found.int()).clamp_(min=0)
            backoff = is_found & (budget == 0)
            absorbed = is_found & ~backoff
            scale.copy_(torch.where(absorbed, prev, scale))
            refill = ~is_found
            if not pol.consecutive_hysteresis:
                refill = refill & (tracker == 0)  # the scale grew this step
            budget.copy_(torch.where(refill, pol.hysteresis, budget))
        collapse = backoff & (prev <= pol.min_scale) if pol.min_scale is not None else no
        floored = capped = no
        if pol.min_scale is not None or pol.max_scale is not None:
            unclamped = scale.clone()
            scale.clamp_(min=pol.min_scale, max=pol.max_scale)
            floored, capped = scale > unclamped, scale < unclamped
        return collapse, torch.stack([absorbed, floored, capped])

    def _budget_on(self, device: torch.device) -> torch.Tensor:
        if self._budget is None or self._budget.device != device:
            self._budget = torch.full((), self.policy.hysteresis, dtype=torch.int32, device=device)
        return self._budget


def grad_scaler(config: Any, device: str = "cuda") -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` with the scale settings of an :class:`ampguard.ScalerConfig`.

    Hand it to a framework that takes a scaler (Lightning's ``MixedPrecision(scaler=...)``) and
    pass :func:`guard_options` of the same config to ampguard's callback for the floor, cap and
    hysteresis.
    """
    from ampguard.core.scaler import ScalerConfig

    if not isinstance(config, ScalerConfig):
        raise TypeError(f"config must be an ampguard.ScalerConfig, got {type(config).__name__}")
    if not config.dynamic:
        raise ValueError(
            "config.dynamic=False (a fixed scale) has no GradScaler equivalent; use dynamic=True"
        )
    return torch.amp.GradScaler(
        device,
        init_scale=config.init_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.growth_interval,
    )


def guard_options(config: Any) -> dict[str, Any]:
    """The attach-mode guard options (``min_scale``, ``max_scale``, ``hysteresis``,
    ``consecutive_hysteresis``, ``on_collapse``) of an :class:`ampguard.ScalerConfig`.

    ``on_collapse="fallback"`` needs the Guard (it switches the autocast dtype) and is refused.
    """
    from ampguard.core.scaler import ScalerConfig

    if not isinstance(config, ScalerConfig):
        raise TypeError(f"config must be an ampguard.ScalerConfig, got {type(config).__name__}")
    if config.on_collapse not in COLLAPSE_POLICIES:
        raise ValueError(
            f"on_collapse={config.on_collapse!r} needs ampguard.Guard (it changes "
            f"the loop's precision); attach mode supports {COLLAPSE_POLICIES}"
        )
    return {
        "min_scale": config.min_scale,
        "max_scale": config.max_scale,
        "hysteresis": config.hysteresis,
        "consecutive_hysteresis": config.consecutive_hysteresis,
        "on_collapse": config.on_collapse,
    }
