"""The self-contained ``report.html``: inline CSS, figures as base64 PNG, no scripts."""

from __future__ import annotations

import base64
import html
import json
from typing import Any

from ampguard.findings import Finding
from ampguard.reporting._fp8 import html_section
from ampguard.reporting._spikes import html_section as spikes_section
from ampguard.reporting._unscaled import what_ran, without_loss_scale
from ampguard.runlog import COVERAGE, RunLog, read_coverage

__all__ = ["render"]

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1b1b1b;
background:#fafafa}
main{max-width:980px;margin:0 auto;padding:18px 22px 40px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid
#ddd;padding-bottom:4px}
.sub{color:#555;margin:0 0 12px}
.facts{display:flex;flex-wrap:wrap;gap:8px}
.fact{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:6px 10px}
.fact b{display:block;font-size:16px}
.finding{background:#fff;border:1px solid #e3e3e3;border-left:5px solid #999;border-radius:6px;
padding:8px 12px;margin:8px 0}
.finding.error{border-left-color:#d00000}.finding.warning{border-left-color:#f4a261}
.finding.info{border-left-color:#457b9d}
.code{font-weight:700;font-family:ui-monospace,monospace}
.fix{margin-top:4px}.fix b{color:#2a9d8f}
pre{background:#f3f3f3;padding:6px 8px;border-radius:4px;overflow-x:auto;font-size:12px;
margin:6px 0 0;white-space:pre-wrap;overflow-wrap:anywhere;max-width:100%}
.finding{min-width:0;overflow-wrap:anywhere}
img{max-width:100%;background:#fff;border:1px solid #e3e3e3;border-radius:6px}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #e3e3e3;padding:4px 8px;text-align:left;vertical-align:top;font-size:13px}
th{background:#f0f0f0}.ok{color:#2a9d8f;font-weight:600}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _finding(f: Finding) -> str:
    where = f" &middot; step {f.step}" if f.step is not None else ""
    evidence = json.dumps(f.evidence, indent=None, default=str)
    return (
        f'<div class="finding {_e(f.severity)}"><span class="code">{_e(f.code)}</span> '
        f"[{_e(f.severity)}] <b>{_e(f.title)}</b>{where}<div>{_e(f.message)}</div>"
        f'<div class="fix"><b>Fix:</b> {_e(f.fix)}</div>'
        f"<pre>{_e(evidence)}</pre></div>"
    )


def _facts(facts: dict[str, Any]) -> str:
    items = [
        ("steps", facts["steps"]),
        ("skipped", f"{facts['skipped']} ({facts['skip_share']:.1%})"),
        ("precision", facts["precision"]),
        ("scale now", _g(facts["scale_last"])),
        ("lowest scale", _g(facts["scale_min"])),
        ("scale changes", facts["scale_changes"]),
        ("micro-batches dropped", facts["dropped"]),
    ]
    if facts.get("unrecorded"):  # a full or read-only disk kept steps out of the log
        items.append(("not recorded", "; ".join(facts["unrecorded"])))
    diag = facts.get("diagnostics") or {}
    if diag:  # Guard.diagnostics() at close: what the run log alone does not say
        items.append(("consecutive skips at end", diag.get("consecutive_skips", "-")))
        items.append(
            ("fallbacks", "; ".join(_fallback_text(f) for f in diag.get("fallbacks", [])) or "none")
        )
    return (
        '<div class="facts">'
        + "".join(f'<div class="fact">{_e(k)}<b>{_e(v)}</b></div>' for k, v in items)
        + "</div>"
    )


def _fallback_text(change: dict[str, Any]) -> str:
    if "module" in change:
        return f"{change['module'] or '(root)'} kept in fp32 at step {change.get('step')}"
    return f"{change.get('from')} -> {change.get('to')} at step {change.get('step')}"


def _coverage(run: RunLog, limit: int = 40) -> str:
    """The autocast census of ``Guard(coverage_step=N)`` (``coverage.json``), if recorded."""
    path = run.run_dir / COVERAGE
    cov = read_coverage(path) if path.exists() else None
    if cov is None:
        return ""
    rows = []
    for name, m in list(cov.get("modules", {}).items())[:limit]:
        cells = (
            name or "(root)",
            _counts(m.get("heavy_forward")),
            _counts(m.get("heavy_backward")),
            _counts(m.get("forward")),
            _counts(m.get("backward")),
        )
        rows.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    escaped = ", ".join(str(e.get("module") or "(root)") for e in cov.get("escaped") or [])
    fragile = ", ".join(
        sorted({f"{f.get('module') or '(root)'}: {f.get('op')}" for f in cov.get("fragile") or []})
    )
    flagged = [
        f"escaped autocast (AG310): {_e(escaped or 'none')}",
        f"fragile ops in low precision (AG311): {_e(fragile or 'none')}",
    ]
    return (
        f"<h2>Autocast coverage (step {_e(cov.get('step'))}, {_e(cov.get('precision'))})</h2>"
        f"<p>{' &middot; '.join(flagged)}</p><table><tr><th>module</th>"
        "<th>matmul-family ops, forward</th><th>matmul-family ops, backward</th>"
        "<th>all ops, forward</th><th>all ops, backward</th></tr>" + "".join(rows) + "</table>"
    )


def _counts(counts: dict[str, int] | None) -> str:
    if not isinstance(counts, dict):  # a hand-edited coverage.json: show nothing, not crash
        return "-"
    return " ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str)) or "-"


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _causes(causes: dict[str, list[int]], total: int) -> str:
    rows = []
    for cause, steps in causes.items():
        if not steps:
            continue
        shown = ", ".join(str(s) for s in steps[:12]) + (" ..." if len(steps) > 12 else "")
        share = f"{len(steps) / total:.1%}" if total else "-"
        rows.append(
            f"<tr><td>{_e(cause)}</td><td>{len(steps)}</td><td>{share}</td>"
            f"<td>{_e(shown)}</td></tr>"
        )
    if not rows:
        return '<p class="ok">No step was skipped.</p>'
    return (
        "<table><tr><th>cause</th><th>steps</th><th>share of all steps</th>"
        "<th>which</th></tr>" + "".join(rows) + "</table>"
    )


def _meta(run: RunLog) -> str:
    m = run.meta
    rows = [
        ("run folder", str(run.run_dir)),
        ("model", m.get("model")),
        ("precision", f"{m.get('precision')} (requested {m.get('requested_precision')})"),
        ("scaler", m.get("scaler"))
        if not without_loss_scale(run)
        else ("loss scale", what_ran(run)),
        ("guard", m.get("guard")),
        ("telemetry", m.get("telemetry")),
        ("device", m.get("device")),
        ("torch", m.get("torch_version")),
        ("ampguard", m.get("ampguard_version")),
        ("python", m.get("python")),
        ("platform", m.get("platform")),
        ("started", m.get("start_time")),
        ("ended", m.get("end_time", "-")),
        ("layers", len(run.layers)),
        ("resumes", m.get("resumes") or "none"),
    ]
    if m.get("distributed"):
        rows.append(("distributed", m["distributed"]))
    body = "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(json.dumps(v, default=str) if isinstance(v, (dict, list)) else v)}</td></tr>"  # noqa: E501
        for k, v in rows
    )
    return f"<table>{body}</table>"


def render(
    run: RunLog,
    findings: list[Finding],
    facts: dict[str, Any],
    causes: dict[str, list[int]],
    figures: list[tuple[str, bytes | str | None]],
) -> str:
    """The whole page as a string (UTF-8, no external resources)."""
    if findings:
        found = "".join(_finding(f) for f in findings)
    else:
        found = '<p class="ok">No findings: nothing to fix.</p>'
    figs = []
    for title, png in figures:
        if png is None:
            figs.append(f"<h2>{_e(title)}</h2><p>Not recorded in this run.</p>")
            continue
        if isinstance(png, str):  # a panel that does not apply: what ran instead
            figs.append(f"<h2>{_e(title)}</h2><p>{_e(png)}</p>")
            continue
        data = base64.b64encode(png).decode("ascii")
        figs.append(
            f'<h2>{_e(title)}</h2><img alt="{_e(title)}" src="data:image/png;base64,{data}">'
        )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>ampguard report: {_e(run.run_dir.name)}</title><style>{_CSS}</style>"
        f"</head><body><main><h1>ampguard report</h1>"
        f'<p class="sub">{_e(run.run_dir)} &middot; {_e(run.meta.get("model", {}).get("class"))}'
        f" &middot; {len(findings)} finding(s)</p>{_facts(facts)}"
        f"<h2>Findings</h2>{found}{''.join(figs)}"
        f"<h2>Skipped steps by cause</h2>{_causes(causes, facts['steps'])}"
        f"{_coverage(run)}{html_section(run)}{spikes_section(run)}"
        f"<h2>Run metadata</h2>{_meta(run)}</main></body></html>"
    )
