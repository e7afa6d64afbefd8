"""fp8 rescue during training: a converted layer that drifts out of fp8's window goes back to bf16.

Under ``Guard(precision="fp8", auto_fallback=True, telemetry=...)`` the fp8 monitor
(:mod:`ampguard.fp8._stats`) samples every converted layer on the range-sampling steps. Each time
it writes its samples out (its one host sync, every 8 samples and at ``findings``/``close``),
:class:`Fp8Rescue` looks at them: a layer whose input or weight flushed share, or output gradient
flushed share, is above the plan's limit (:class:`ampguard.Fp8Thresholds`) on
``RESCUE_AFTER`` consecutive samples is moved back to bf16 at once: its ``Float8Linear`` becomes
the ``nn.Linear`` it was (the same module object, parameters, hooks and optimizer state; only the
forward changes), so training continues without a restart.

Each rescue is recorded like an fp16 fallback: ``{"step", "module", "from": "fp8", "to": "bf16",
"reason": "fp8_rescue", "field", "value", "limit"}`` in ``guard.diagnostics()["fallbacks"]``, an
``{"kind": "fp8_rescue", ...}`` event in the run log, the report's fp8 section, the Guard state
(a resumed Guard moves the same layers back before its first step) and an AG113 finding.
Cost: none per step; a few Python comparisons per written sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from ampguard.findings import Finding, make

if TYPE_CHECKING:
    from ampguard.fp8._stats import Fp8Log

__all__ = ["Fp8Rescue", "RESCUE_AFTER", "to_bf16"]

RESCUE_AFTER = 2  # consecutive samples over the limit (one noisy batch does not move a layer)
_FIELDS = (
    ("input_flushed", "max_input_flushed"),
    ("weight_flushed", "max_weight_flushed"),
    ("grad_flushed", "max_grad_flushed"),
)


def to_bf16(module: nn.Module) -> None:
    """Turn a torchao ``Float8Linear`` back into the plain ``nn.Linear`` it was converted from.

    ``Float8Linear`` subclasses ``nn.Linear`` and keeps its parameters, so restoring the class
    keeps the module object, its parameters (and so the optimizer state), buffers and hooks;
    the forward is ``nn.Linear``'s again (under the Guard's bf16 autocast).
    """
    if not isinstance(module, nn.Linear):
        raise TypeError(f"fp8 rescue: expected a Float8Linear, got {type(module).__name__}")
    module.__class__ = nn.Linear


class Fp8Layers(Protocol):
    """The fp8 layers a rescue moves (:class:`ampguard.fp8._convert.Fp8State`)."""

    layers: list[str]

    def release(self, name: str) -> None: ...


class Fp8Rescue:
    """Decides and records the rescues of one fp8 Guard (see the module docstring)."""

    def __init__(self, state: Fp8Layers, telemetry: Fp8Log | None, thresholds: Any) -> None:
        self.state = state
        self.telemetry = telemetry
        self.thresholds = thresholds
        self.changes: list[dict[str, Any]] = []
        self._over: dict[str, int] = {}

    def on_samples(self, records: list[dict[str, Any]]) -> None:
        """Look at freshly written samples (oldest first); move drifting layers to bf16."""
        for rec in records:
            for name, figures in rec["layers"].items():
                if name not in self.state.layers:
                    continue
                over = self._first_over(figures)
                self._over[name] = self._over.get(name, 0) + 1 if over else 0
                if over and self._over[name] >= RESCUE_AFTER:
                    self.rescue(name, rec["step"], *over)

    def _first_over(self, figures: dict[str, Any]) -> tuple[str, float, float] | None:
        for key, limit_name in _FIELDS:
            value, limit = figures.get(key), getattr(self.thresholds, limit_name)
            if value is not None and value > limit:
                return key, float(value), float(limit)
        return None

    def rescue(self, name: str, step: int, field: str, value: float, limit: float) -> None:
        """Move ``name`` to bf16 now and record it."""
        self.state.release(name)
        change = {
            "step": step,
            "module": name,
            "from": "fp8",
            "to": "bf16",
            "reason": "fp8_rescue",
            "field": field,
            "value": value,
            "limit": limit,
        }
        self.changes.append(change)
        telemetry = self.telemetry
        if telemetry is not None and not telemetry.closed:
            telemetry.append_events([{"kind": "fp8_rescue", **change}])

    def resume(self, changes: list[dict[str, Any]]) -> None:
        """Re-apply saved rescues (names already checked against this Guard's fp8 layers)."""
        for change in changes:
            if change["module"] in self.state.layers:
                self.state.release(change["module"])
            self.changes.append(dict(change))

    def findings(self) -> list[Finding]:
        """One AG113 per rescued layer."""
        out = []
        for c in self.changes:
            what = c["field"].split("_")[0]
            what = "output gradient" if what == "grad" else what
            out.append(
                make(
                    "AG113",
                    f"{c['module']}: moved from fp8 to bf16 at step {c['step']}: "
                    f"{c['value']:.2%} of its {what}'s nonzero values flushed to zero in fp8 "
                    f"(limit {c['limit']:.2%}) on {RESCUE_AFTER} samples in a row",
                    step=c["step"],
                    evidence=dict(c),
                    fix=f"keep {c['module']!r} in bf16 from the start: make a plan with "
                    "ag.fp8_plan on a batch from this point of training and pass fp8_plan=",
                )
            )
        return out
