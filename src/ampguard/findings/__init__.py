"""Findings: the one shape every diagnosis in ampguard takes.

A :class:`Finding` is what a user reads: a stable code (AG1xx runtime, AG2xx lint, AG3xx
forensics/advisor), a severity, a one-line title, a message, the evidence that triggered it and a
concrete fix. Every code is listed in :data:`ampguard.findings.codes.CATALOGUE` (a finding
refuses any other), and :func:`make` fills in the catalogue's title, severity and fix. This module
imports no torch, so the linter can use it and start fast.
"""

from ampguard.findings._finding import SEVERITIES, Finding, count, make

__all__ = ["Finding", "SEVERITIES", "count", "make"]
