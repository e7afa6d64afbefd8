"""Printing findings: ``path:line:col: CODE [severity] message`` text with the fix under it, a
JSON list, or SARIF 2.1.0; and which severities fail a run (``--fail-on``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path, PurePath

from ampguard.findings import Finding
from ampguard.lint.rules import RULES

__all__ = [
    "FORMATS",
    "SEVERITIES",
    "failing",
    "fixable",
    "format_findings",
    "sort_findings",
    "summary_line",
]

FORMATS = ("text", "json", "sarif")
SEVERITIES = ("error", "warning", "info")  # most severe first
_SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Findings in (path, line, column, code) order."""
    return sorted(findings, key=lambda f: (f.path or "", f.line or 0, f.col or 0, f.code))


def format_findings(findings: Iterable[Finding], fmt: str = "text") -> str:
    """Render ``findings`` as ``text``, ``json`` or ``sarif`` (always ends with a newline)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    items = sort_findings(findings)
    if fmt == "text":
        return "".join(_text(f) for f in items)
    if fmt == "json":
        return json.dumps([f.to_dict() for f in items], indent=2) + "\n"
    return json.dumps(_sarif(items), indent=2) + "\n"


def _text(f: Finding) -> str:
    """``path:line:col: CODE [severity] message`` and, indented under it, ``fix: ...``: the first
    line is what editors' problem matchers read; the second never looks like a location. A
    finding ``ampguard lint --fix`` can rewrite is marked ``[*]`` after its severity (as ruff
    marks its fixable findings)."""
    mark = " [*]" if fixable(f) else ""
    head = f"{f.path}:{f.line}:{f.col}: {f.code} [{f.severity}]{mark} {f.message}\n"
    return head + (f"    fix: {f.fix}\n" if f.fix else "")


def fixable(f: Finding) -> bool:
    """``--fix`` would rewrite ``f``: of a code it rewrites (not an AG206 fallback for old
    torch, kept on purpose, nor a finding whose rule says it cannot be: ``fixable`` false in its
    evidence), and, when its file can be read, of a shape it rewrites (the fixer is asked, on
    the text in memory; nothing is written). Cost: one parse of the file per such finding,
    cached while the file is unchanged."""
    from ampguard.lint._fix import FIXABLE  # the fixer imports the engine, which imports this

    if not (
        f.code in FIXABLE
        and not f.evidence.get("fallback")
        and f.evidence.get("fixable", True) is not False
    ):
        return False
    try:
        stat = os.stat(f.path) if f.path else None
    except OSError:
        stat = None
    if stat is None or not os.path.isfile(f.path or ""):
        return True  # no file to ask about (a string was linted): judged by its code
    key = (f.path, stat.st_mtime_ns, stat.st_size, f.line, f.col, f.code, f.message)
    found = _FIXABLE_CACHE.get(key)
    if found is None:
        found = _ask_fixer(f)
        if len(_FIXABLE_CACHE) > 4096:
            _FIXABLE_CACHE.clear()
        _FIXABLE_CACHE[key] = found
    return found


_FIXABLE_CACHE: dict[tuple, bool] = {}


def _ask_fixer(f: Finding) -> bool:
    from ampguard.lint._engine import make_options
    from ampguard.lint._fix import decode, fix_text

    try:
        with open(f.path or "", "rb") as handle:
            text, _ = decode(handle.read())
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError):
        return True
    options = make_options(select=[f.code], torch_version="2.6")
    fixed = fix_text(text, f.path or "", options, lint=lambda t: [f] if t == text else [])
    return bool(fixed.fixed)


def _rank(severity: str, argument: str) -> int:
    if severity not in SEVERITIES:
        raise ValueError(f"{argument} must be one of {', '.join(SEVERITIES)}, got {severity!r}")
    return SEVERITIES.index(severity)


def failing(findings: Iterable[Finding], fail_on: str = "warning") -> list[Finding]:
    """The findings at ``fail_on`` severity or worse (``"error"``, ``"warning"``, ``"info"``):
    those that make ``ampguard lint`` exit 1. With the default, an ``info`` hint never fails a
    pre-commit hook."""
    limit = _rank(fail_on, "fail_on")
    return [f for f in findings if SEVERITIES.index(f.severity) <= limit]


def summary_line(findings: list[Finding], fail_on: str = "warning") -> str:
    """``3 findings (1 error, 1 warning, 1 info); 2 at --fail-on warning or worse``."""
    counts = [(s, sum(1 for f in findings if f.severity == s)) for s in SEVERITIES]
    parts = ", ".join(f"{n} {s}" for s, n in counts if n)
    noun = "finding" if len(findings) == 1 else "findings"
    bad = len(failing(findings, fail_on))
    line = f"{len(findings)} {noun} ({parts}); {bad} at --fail-on {fail_on} or worse"
    mendable = sum(1 for f in findings if fixable(f))
    return line + (f"; [*] {mendable} fixable with --fix" if mendable else "")


def _uri(path: str | None) -> str:
    if not path:
        return "<unknown>"
    if os.path.isabs(path):
        return Path(path).as_uri()
    return PurePath(path).as_posix()


def _sarif(findings: list[Finding]) -> dict:
    from ampguard._version import __version__

    codes = sorted(RULES)
    rules = [
        {
            "id": code,
            "name": RULES[code].title.replace(" ", "-"),
            "shortDescription": {"text": RULES[code].title},
            "fullDescription": {"text": f"{RULES[code].title}. Fix: {RULES[code].fix}"},
            "help": {"text": RULES[code].fix},
            "defaultConfiguration": {"level": _SARIF_LEVEL[RULES[code].severity]},
        }
        for code in codes
    ]
    results = [
        {
            "ruleId": f.code,
            "ruleIndex": codes.index(f.code) if f.code in RULES else 0,
            "level": _SARIF_LEVEL.get(f.severity, "warning"),
            "message": {"text": f"{f.message}. Fix: {f.fix}" if f.fix else f.message},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": _uri(f.path)},
                        "region": {"startLine": f.line or 1, "startColumn": f.col or 1},
                    }
                }
            ],
        }
        for f in findings
    ]
    return {
        "$schema": _SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "ampguard-lint",
                        "version": __version__,
                        "rules": rules,
                    }
                },
                "results": results,
            }
        ],
    }
