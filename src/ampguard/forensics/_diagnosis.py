"""What :func:`ampguard.forensics.locate` answers: a :class:`Diagnosis`, its kinds and codes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ampguard.findings import Finding, make
from ampguard.forensics import _optimizer
from ampguard.forensics._text import explain, fix_for, title_for

__all__ = ["CODES", "KINDS", "Diagnosis"]

KINDS = (
    "fp16_overflow",
    "fp16_underflow",
    "fp16_overflow_absorbed",
    "model_nonfinite",
    "input_nonfinite",
    "none",
    *_optimizer.KINDS,
)
CODES = {
    "none": "AG300",
    "fp16_overflow": "AG301",
    "fp16_underflow": "AG302",
    "fp16_overflow_absorbed": "AG360",
    "model_nonfinite": "AG303",
    "input_nonfinite": "AG304",
    "probe": "AG305",
    "precision_stagnation": "AG365",
    "eps_underflow": "AG366",
}


@dataclass(frozen=True)
class Diagnosis:
    """Where and why a batch goes non-finite (or flushes to zero) in mixed precision.

    ``kind`` is one of :data:`KINDS`; ``phase`` "forward" | "backward" | "optimizer" | None;
    ``module`` a name from ``model.named_modules()`` (``""`` the root) or None outside the model;
    ``op`` an aten op such as ``"aten.addmm"``; ``stats`` the evidence (max |x| in low precision
    and fp32 at that point, NaN/inf counts, dtype, shape, loss scale); ``benign`` marks a
    loss-scale probe.
    """

    kind: str
    phase: str | None
    module: str | None
    op: str | None
    stats: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp16"
    scale: float = 1.0
    benign: bool = False

    @property
    def code(self) -> str:
        """The AG3xx finding code (AG300-AG305, AG360, AG365, AG366)."""
        return CODES["probe"] if self.benign else CODES[self.kind]

    @property
    def ok(self) -> bool:
        """True when there is nothing to fix (kind "none", benign probes included)."""
        return self.kind == "none"

    def explain(self) -> str:
        """A few sentences: what happened, where, the evidence, and the fix."""
        return explain(self)

    def to_finding(self, step: int | None = None) -> Finding:
        """This diagnosis as a :class:`~ampguard.findings.Finding`.

        The message is :meth:`explain` without its closing "Fix: ...", which is the ``fix``
        field (reports print both, so it would otherwise appear twice).
        """
        fix = fix_for(self)
        message = self.explain().removesuffix(f" Fix: {fix}")
        return make(
            self.code, message, title=title_for(self), step=step, evidence=self.to_dict(), fix=fix
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; :meth:`from_dict` inverts it."""
        return {
            "kind": self.kind,
            "phase": self.phase,
            "module": self.module,
            "op": self.op,
            "stats": _json_safe(self.stats),
            "precision": self.precision,
            "scale": self.scale,
            "benign": self.benign,
            "code": self.code,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Diagnosis:
        """Inverse of :meth:`to_dict` (``"nan"``/``"inf"`` strings become floats again)."""
        keys = ("kind", "phase", "module", "op", "precision", "scale", "benign")
        return cls(
            **{k: data[k] for k in keys if k in data}, stats=_json_restore(data.get("stats", {}))
        )

    def __str__(self) -> str:
        if self.module is None and self.op is None:
            return f"{self.code} {self.kind}"
        where = f"{self.module!r}" if self.module is not None else "outside the model"
        return f"{self.code} {self.kind} ({self.phase or '-'}) at {where} {self.op or ''}".rstrip()


def _json_safe(value: Any) -> Any:
    """Non-finite floats as "nan"/"inf"/"-inf" strings, recursively (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _json_restore(value: Any) -> Any:
    if value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, dict):
        return {k: _json_restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_restore(v) for v in value]
    return value


Diagnosis.__module__ = "ampguard.forensics"  # its public home: repr and pickles name that path
