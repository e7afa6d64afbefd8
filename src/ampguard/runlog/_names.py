"""The names of the files in a run folder (the layout the package docstring describes)."""

from __future__ import annotations

__all__ = ["COVERAGE", "EVENTS", "FINDINGS", "FINDING_EVENT", "META", "REPORT", "TB_DIR"]

EVENTS = "events.jsonl"
META = "meta.json"
FINDINGS = "findings.json"
COVERAGE = "coverage.json"  # Guard(coverage_step=N): the autocast census of that step
REPORT = "report.html"
TB_DIR = "tb"
FINDING_EVENT = "finding"  # events.jsonl line kind: {"kind": "finding", "step", "finding": {...}}
