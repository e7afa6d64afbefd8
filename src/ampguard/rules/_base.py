"""Shared pieces of the AG1xx rules: thresholds, the finding builder (titles: the catalogue)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ampguard._util.checks import check_int
from ampguard.findings import Finding, make
from ampguard.findings.codes import CATALOGUE, family
from ampguard.precisions import REGISTRY

__all__ = ["TITLES", "RuleConfig", "make_finding", "fp16_mask"]

# The runtime codes' titles (the family the rules over the run log belong to), read from the
# catalogue: a new code is listed by its catalogue entry alone (kept as ``ampguard.rules.TITLES``).
TITLES = {code: entry.title for code, entry in CATALOGUE.items() if family(code) == "AG1"}


@dataclass(frozen=True)
class RuleConfig:
    """Thresholds of the AG1xx rules (see the module docstring for what each controls)."""

    warmup_clean_steps: int = 10
    warmup_max_steps: int = 100
    collapse_floor_factor: float = 8.0
    collapse_halvings: int = 6
    collapse_window: int = 200
    osc_min_cycles: int = 4
    osc_min_rate: float = 0.01
    skip_rate: float = 0.05
    skip_window: int = 100
    skip_min_steps: int = 20
    dead_steps: int = 20
    saturation_factor: float = 16.0
    underflow_frac: float = 0.05
    resume_gap_bits: int = 4
    bf16_min_samples: int = 2

    def __post_init__(self) -> None:
        for name in (
            "warmup_clean_steps",
            "warmup_max_steps",
            "collapse_halvings",
            "collapse_window",
            "osc_min_cycles",
            "skip_window",
            "skip_min_steps",
            "dead_steps",
            "resume_gap_bits",
            "bf16_min_samples",
        ):
            check_int(f"RuleConfig.{name}", getattr(self, name))
        for name in ("collapse_floor_factor", "saturation_factor"):
            if not getattr(self, name) >= 1:
                raise ValueError(
                    f"RuleConfig.{name} must be a number >= 1, got {getattr(self, name)!r}"
                )
        for name in ("osc_min_rate", "skip_rate", "underflow_frac"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(
                    f"RuleConfig.{name} must be in [0, 1), got {getattr(self, name)!r}"
                )


def make_finding(
    code: str, severity: str, message: str, step: int | None, evidence: dict[str, Any], fix: str
) -> Finding:
    """A :class:`Finding` with the catalogue's title and JSON-plain evidence (NaN/inf -> None)."""
    return make(code, message, severity=severity, step=step, evidence=_plain(evidence), fix=fix)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def fp16_mask(precisions: list[str]) -> np.ndarray:
    """True where the step ran in a precision that rounds to float16 (the rules about fp16's
    range judge only those)."""
    return np.array([_rounds_to_fp16(p) for p in precisions], dtype=bool)


def _rounds_to_fp16(name: str) -> bool:
    entry = REGISTRY.get(name)
    return entry is not None and entry.low_dtype == "float16"


RuleConfig.__module__ = "ampguard.rules"  # its public home: repr and pickles name that path
