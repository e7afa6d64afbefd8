"""The names of the files in a run folder (the layout the package docstring describes)."""

from __future__ import annotations

__all__ = [
    "COVERAGE",
    "EVENTS",
    "FINDINGS",
    "FINDING_EVENT",
    "FLIGHT_RECORDER_DIR",
    "FLIGHT_RECORDER_KIND",
    "FLIGHT_RECORDER_VERSION",
    "META",
    "REPORT",
    "TB_DIR",
    "TRIAGE_DIR",
    "TRIAGE_KIND",
    "TRIAGE_VERSION",
]

EVENTS = "events.jsonl"
META = "meta.json"
FINDINGS = "findings.json"
COVERAGE = "coverage.json"  # Guard(coverage_step=N): the autocast census of that step
REPORT = "report.html"
TB_DIR = "tb"
FINDING_EVENT = "finding"  # events.jsonl line kind: {"kind": "finding", "step", "finding": {...}}
FLIGHT_RECORDER_DIR = "flight_recorder"  # Guard(flight_recorder=N): rank<R>.json, one per rank
FLIGHT_RECORDER_KIND = "ampguard.flight_recorder"  # the dump's "kind"
FLIGHT_RECORDER_VERSION = 1
TRIAGE_DIR = "triage"  # ag.triage: rank<R>.json, the events (ampguard postmortem lists them)
TRIAGE_KIND = "ampguard.triage"
TRIAGE_VERSION = 1
