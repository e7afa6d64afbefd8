"""The terminal summary of a run: findings first, then the numbers behind them."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np

from ampguard.findings import Finding
from ampguard.reporting._fp8 import text_lines as fp8_text_lines
from ampguard.runlog import RunLog

__all__ = ["summary_text", "run_facts"]


def run_facts(run: RunLog, causes: dict[str, list[int]]) -> dict[str, Any]:
    """Headline numbers of a run (used by the terminal summary and the HTML header)."""
    n = len(run.steps)
    skipped = int((~run.applied).sum())
    scales = run.scale[np.isfinite(run.scale)]
    return {
        "steps": n,
        "first_step": int(run.steps[0]) if n else None,
        "last_step": int(run.steps[-1]) if n else None,
        "skipped": skipped,
        "skip_share": skipped / n if n else 0.0,
        "causes": {k: len(v) for k, v in causes.items() if v},
        "scale_first": float(run.scale_before[0]) if n else None,
        "scale_last": float(run.scale[-1]) if n else None,
        "scale_min": float(scales.min()) if len(scales) else None,
        "scale_changes": int((run.scale != run.scale_before).sum()),
        "precision": run.precision[-1] if n else run.meta.get("precision"),
        "dropped": int(run.dropped.sum()),
        "diagnostics": run.meta.get("diagnostics"),  # Guard.diagnostics() at close, if any
        "unrecorded": unrecorded_texts(run),
    }


def unrecorded_texts(run: RunLog) -> list[str]:
    """ "steps N-M not recorded (disk full)" for every gap a failed write left in the log."""
    out = []
    for g in run.unrecorded:
        span = f"step {g['step']}" if g["step"] == g["last"] else f"steps {g['step']}-{g['last']}"
        out.append(f"{span} not recorded ({g.get('reason') or 'a write failed'})")
    return out


def _wrap(text: str, indent: str) -> str:
    return textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent)


def summary_text(run: RunLog, findings: list[Finding], facts: dict[str, Any]) -> str:
    """Plain-text summary: each finding with its fix, then steps, skips, scale, resumes."""
    model = run.meta.get("model", {})
    lines = [
        f"ampguard report: {run.run_dir}  ({model.get('class', '?')}, "
        f"{model.get('parameters', 0):,} parameters, {facts['precision']})"
    ]
    if findings:
        lines.append(f"findings ({len(findings)}):")
        for f in findings:
            where = f" at step {f.step}" if f.step is not None else ""
            lines.append(f"  {f.code} [{f.severity}] {f.title}{where}")
            lines.append(_wrap(f.message, "      "))
            if f.fix:
                lines.append(_wrap(f"fix: {f.fix}", "      "))
    else:
        lines.append("findings: none")
    if facts["steps"]:
        causes = ", ".join(f"{k} {v}" for k, v in facts["causes"].items()) or "none"
        lines.append(
            f"steps {facts['first_step']}-{facts['last_step']}: {facts['skipped']} "
            f"skipped ({facts['skip_share']:.1%}; {causes})"
        )
        lines.extend(f"  {text}: not counted above" for text in facts["unrecorded"])
        if facts["scale_min"] is None:  # no finite scale in any line (a damaged log)
            lines.append("loss scale: none recorded")
        else:
            lines.append(
                f"loss scale {facts['scale_first']:g} -> {facts['scale_last']:g} (lowest "
                f"{facts['scale_min']:g}, {facts['scale_changes']} changes)"
            )
    else:
        lines.append("no steps recorded yet")
        lines.extend(facts["unrecorded"])
    for r in run.resumes:
        prev = r.get("previous_scale")
        lines.append(
            f"resumed at step {r['step']}: scale {r.get('scale')} (before: {prev}"
            f"{', reset' if r.get('scale_reset') else ''})"
        )
    for fb in run.fallbacks:
        lines.append(f"fallback at step {fb['step']}: {fb.get('from')} -> {fb.get('to')}")
    lines.extend(fp8_text_lines(run))  # fp8 runs: converted layers, worst flushed shares
    if run.bad_lines:
        lines.append(f"skipped {run.bad_lines} unreadable line(s) of the run log")
    return "\n".join(lines)
