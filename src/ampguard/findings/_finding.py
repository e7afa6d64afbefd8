"""The :class:`Finding` record, :func:`make` (filled in from the catalogue) and :func:`count`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ampguard.findings.codes import CATALOGUE, lookup

__all__ = ["Finding", "SEVERITIES", "count", "make"]

SEVERITIES = ("info", "warning", "error")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 step"``, ``"3 steps"``: a number with its noun in the right number for messages."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


@dataclass(frozen=True)
class Finding:
    """One diagnosis with its evidence and a fix.

    ``code`` must be in the catalogue (:data:`ampguard.findings.codes.CATALOGUE`); :func:`make`
    builds a finding with the catalogue's title, severity and fix filled in.

    ``step`` is the training step it refers to (runtime findings); ``path``/``line``/``col`` locate
    it in a source file (lint findings). ``evidence`` holds plain JSON-serialisable values.
    """

    code: str
    severity: str
    title: str
    message: str
    step: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    path: str | None = None
    line: int | None = None
    col: int | None = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not (isinstance(self.code, str) and self.code.startswith("AG")):
            raise ValueError(f"code must be an 'AGnnn' string, got {self.code!r}")
        if self.code not in CATALOGUE:
            raise ValueError(
                f"finding code {self.code!r} is not in ampguard's catalogue "
                "(ampguard.findings.codes.CATALOGUE): add it there first"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready); ``None`` location fields are left out."""
        out = dataclasses.asdict(self)
        return {k: v for k, v in out.items() if v is not None or k == "step"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def __str__(self) -> str:
        where = f" (step {self.step})" if self.step is not None else ""
        return f"{self.code} [{self.severity}] {self.title}{where}: {self.message}"


def make(
    code: str,
    message: str,
    *,
    severity: str | None = None,
    title: str | None = None,
    detail: str | None = None,
    step: int | None = None,
    evidence: dict[str, Any] | None = None,
    fix: str | None = None,
    path: str | None = None,
    line: int | None = None,
    col: int | None = None,
) -> Finding:
    """A :class:`Finding` of ``code`` with what the catalogue knows filled in.

    ``severity``, ``title`` and ``fix`` default to the catalogue's (the severity is the code's
    default; pass the actual one where it varies). ``detail`` is appended to the title after a
    colon (``"module escaped autocast: 'fc1'"``), so the title always starts with the
    catalogue's. ``KeyError`` names a code that is not catalogued.
    """
    entry = lookup(code)
    head = entry.title if title is None else title
    return Finding(
        code,
        entry.severity if severity is None else severity,
        head if detail is None else f"{head}: {detail}",
        message,
        step=step,
        evidence={} if evidence is None else evidence,
        fix=entry.fix if fix is None else fix,
        path=path,
        line=line,
        col=col,
    )


Finding.__module__ = "ampguard.findings"  # its public home: repr and pickles name that path
