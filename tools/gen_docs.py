"""Generate the docs pages that come from the code: the findings catalogue and the API reference.

    python tools/gen_docs.py            # rewrite findings.md, reference.md, __init__'s imports
    python tools/gen_docs.py --check    # exit 1 (naming the stale file) when one is out of date

``docs/findings.md`` lists every code of :data:`ampguard.findings.codes.CATALOGUE` by area: what
fires it,
an example (a snippet that fires it for lint codes; for the others a real finding recorded from a
test or demo run, kept in ``docs/findings_examples.json``) and the fix.

``docs/reference.md`` gets one mkdocstrings entry (``::: ampguard.Name``) per name in
``ampguard.__all__``, grouped by topic; a name no group lists goes under "Other names", so a new
export is never left out. Its "API at a glance" block (between the ``api-at-a-glance`` markers,
filled by ``tools/split_readme.py``) is kept.

``src/ampguard/__init__.py`` gets its ``if TYPE_CHECKING:`` imports regenerated from ``_EXPORTS``
(so griffe and mypy see ``ampguard.Guard``; at run time the exports stay lazy).
``tests/test_docs.py`` runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import ampguard  # noqa: E402  (lazy: importing it imports no torch)
from ampguard.findings.codes import AREAS, CATALOGUE, FAMILIES, Code  # noqa: E402

FINDINGS = ROOT / "docs" / "findings.md"
INIT = ROOT / "src" / "ampguard" / "__init__.py"
TC_HEAD = "if TYPE_CHECKING:  # the names for type checkers and the docs (griffe): mirrors _EXPORTS"
EXAMPLES = ROOT / "docs" / "findings_examples.json"  # real findings, one per code, from test runs
REFERENCE = ROOT / "docs" / "reference.md"
REF_MARK = "<!-- reference:generated below by tools/gen_docs.py -->"

AREA_TITLES = {
    "runtime": "Runtime rules over the run log",
    "step": "The guarded step",
    "attach": "Attach mode: ag.watch and the integrations",
    "distributed": "Distributed",
    "fp8": "fp8",
    "lint": "Lint (static checks, no torch)",
    "forensics": "Forensics: ag.locate",
    "coverage": "Autocast coverage",
    "advisor": "The model advisor: ag.inspect_model",
    "compare": "A/B experiments: ag.compare",
}

GROUPS: list[tuple[str, tuple[str, ...]]] = [
    (
        "The guarded step",
        (
            "Guard",
            "StepResult",
            "ScalerConfig",
            "LossScaler",
            "ScaleCollapseError",
            "PrecisionPolicy",
            "resolve_precision",
            "ResumeWarmup",
        ),
    ),
    (
        "Checkpoints",
        (
            "save_checkpoint",
            "load_checkpoint",
            "CheckpointError",
            "save_distributed_checkpoint",
            "load_distributed_checkpoint",
        ),
    ),
    (
        "Telemetry, findings and the report",
        ("Telemetry", "TelemetryError", "RuleConfig", "report", "Finding"),
    ),
    ("Forensics and autocast coverage", ("locate", "Diagnosis", "coverage", "Coverage")),
    ("Compare and the advisor", ("Experiment", "Comparison", "compare", "inspect_model")),
    ("Lint", ("lint_source", "lint_paths")),
    ("Distributed", ("DesyncError",)),
    ("Integrations", ("watch",)),
    ("Testing", ("SyncCounter",)),
]


# ---------------------------------------------------------------------- findings.md
def _wrap(text: str) -> str:
    return textwrap.fill(text, width=96, initial_indent="    ", subsequent_indent="    ")


def _example(c: Code, seen: dict[str, Any]) -> str:
    if c.example:
        return (
            f"Example (this script gets {c.code} from `ampguard lint`):\n\n```python\n"
            f"{c.example.rstrip()}\n```\n"
        )
    real = seen.get(c.code)
    if real is None:
        return (
            f"In `ampguard report` and `findings.json` it reads `{c.code} [{c.severity}] "
            f"{c.title}`, then what was measured and the fix for this run.\n"
        )
    where = f" at step {real['step']}" if real.get("step") is not None else ""
    return (
        f"Example (a real finding from a test or demo run):\n\n```text\n"
        f"{c.code} [{real['severity']}] {real['title']}{where}\n{_wrap(real['message'])}\n"
        f"{_wrap('fix: ' + real['fix'])}\n```\n"
    )


def _entry(c: Code, seen: dict[str, Any]) -> str:
    return (
        f"### {c.code}: {c.title} {{ #{c.code.lower()} }}\n\n"
        f"**Severity:** {c.severity} &middot; **Explained in:** [{c.doc}]({c.doc})\n\n"
        f"**Fires when:** {c.fires}.\n\n{_example(c, seen)}\n**Fix:** {c.fix}.\n"
    )


def findings_page() -> str:
    """The findings catalogue page, one section per area in ``AREAS`` order."""
    seen = json.loads(EXAMPLES.read_text(encoding="utf-8")) if EXAMPLES.exists() else {}
    parts = [
        "# Findings catalogue\n",
        "Every finding ampguard can emit has a stable code. This page is generated from "
        "`ampguard.findings.codes.CATALOGUE` by `tools/gen_docs.py`; the severity shown is "
        "the default (a rule may report a milder case at a lower severity, and says so in the "
        "message).\n",
        "Families: " + ", ".join(f"{p}xx {what}" for p, what in FAMILIES.items()) + ".\n",
        "| code | severity | title |",
        "| --- | --- | --- |",
    ]
    parts += [
        f"| [{c.code}](#{c.code.lower()}) | {c.severity} | {c.title} |" for c in CATALOGUE.values()
    ]
    parts.append("")
    for area in AREAS:
        codes = [c for c in CATALOGUE.values() if c.area == area]
        if codes:
            parts.append(f"## {AREA_TITLES.get(area, area)}\n")
            parts += [_entry(c, seen) for c in codes]
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------------- reference.md
def reference_tail() -> str:
    """The generated part of the reference page: a ``:::`` entry per public name."""
    names = [n for n in ampguard.__all__ if n != "__version__"]
    listed = {n for _, group in GROUPS for n in group}
    groups = [(title, [n for n in group if n in names]) for title, group in GROUPS]
    groups.append(("Other names", [n for n in names if n not in listed]))
    out = [REF_MARK, ""]
    for title, members in groups:
        if members:
            out.append(f"## {title}\n")
            out += [f"::: ampguard.{n}\n" for n in members]
    return "\n".join(out).rstrip() + "\n"


def reference_page() -> str:
    text = REFERENCE.read_text(encoding="utf-8")
    if REF_MARK not in text:
        raise SystemExit(f"gen_docs: {REFERENCE} lacks the line {REF_MARK!r}")
    return text.split(REF_MARK, 1)[0] + reference_tail()


# ---------------------------------------------------------------------- ampguard/__init__.py
def type_checking_block() -> str:
    """``if TYPE_CHECKING:`` imports of every lazy export, one ``from m import X as X`` each
    (the explicit re-export form, sorted as ruff's isort sorts them)."""
    lines = [TC_HEAD]
    for module, name in sorted((m, n) for n, m in ampguard._EXPORTS.items()):
        stmt = f"    from {module} import {name} as {name}"
        if len(stmt) > 100:
            stmt = f"    from {module} import (\n        {name} as {name},\n    )"
        lines.append(stmt)
    return "\n".join(lines) + "\n"


def init_page() -> str:
    """``ampguard/__init__.py`` with its ``if TYPE_CHECKING:`` block regenerated."""
    text = INIT.read_text(encoding="utf-8")
    if TC_HEAD not in text:
        raise SystemExit(f"gen_docs: {INIT} lacks the line {TC_HEAD!r}")
    head, rest = text.split(TC_HEAD, 1)
    body = rest.split("\n\n\n", 1)  # the block ends at the next top-level definition
    return head + type_checking_block().rstrip("\n") + "\n\n\n" + body[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that the pages are current")
    args = ap.parse_args(argv)
    pages = {FINDINGS: findings_page(), REFERENCE: reference_page(), INIT: init_page()}
    stale = [
        p for p, text in pages.items() if not p.exists() or p.read_text(encoding="utf-8") != text
    ]
    if args.check:
        for p in stale:
            print(f"gen_docs: {p.relative_to(ROOT)} is out of date: run python tools/gen_docs.py")
        return 1 if stale else 0
    for p in stale:
        p.write_text(pages[p], encoding="utf-8")
        print(f"gen_docs: wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
