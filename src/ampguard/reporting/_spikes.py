"""The report's flight-recorder panel: the postmortem timeline of the run folder's dumps.

What ``ampguard postmortem RUN_DIR`` prints (:mod:`ampguard.reporting.postmortem`), as a section
of ``report.html``: which ranks dumped and why, the first rank, step and layer where something
went wrong, the windows around it (every rank's loss and flags), the largest per-module output
amax of the sampled windows nearest it, and the recorded spikes. Dumps that cannot be used
(unreadable, malformed: the same schema check as the command) are one line naming the file and
the field; the rest of the report is written as usual. A run without dumps has no panel.
"""

from __future__ import annotations

import html
from typing import Any

from ampguard.reporting.postmortem import PostmortemError, amax_around, load, timeline
from ampguard.runlog import FLIGHT_RECORDER_DIR

__all__ = ["TITLE", "html_section"]

TITLE = "Flight recorder: the postmortem timeline"


def html_section(run: Any, around: int = 5) -> str:
    """The panel for the run folder of ``run`` (a ``RunLog``); "" without dumps."""
    if not (run.run_dir / FLIGHT_RECORDER_DIR).is_dir():
        return ""
    e = html.escape
    head = f"<h2>{e(TITLE)}</h2>"
    try:
        pm = load(run.run_dir)
    except PostmortemError as err:
        return f"{head}<p>The dumps cannot be used: {e(str(err))}</p>"
    dumped = ", ".join(
        f"rank {r}: {d.get('trigger')} at step {d['step']}" for r, d in pm.ranks.items()
    )
    parts = [head, f"<p>{len(pm.ranks)} rank(s) dumped ({e(dumped)}).</p>"]
    if pm.first_step is None:
        parts.append('<p class="ok">Nothing went wrong in the recorded windows.</p>')
        return "".join(parts)
    where = f" in layer <b>{e(pm.layer)}</b>" if pm.layer else ""
    jump = pm.evidence.get("grad_norm_jump")
    parts.append(
        f"<p>First: <b>rank {pm.first_rank}, step {pm.first_step}</b>: {e(pm.what)}{where}"
        + (f" (gradient norm jump {e(str(jump))})" if jump else "")
        + "</p>"
    )
    cols = "".join(f"<th>rank {r} loss</th><th>rank {r} flags</th>" for r in pm.ranks)
    body = []
    for step, cells in timeline(pm, around):
        mark = ' style="background:#fde2e2"' if step == pm.first_step else ""
        tds = "".join(f"<td>{_num(loss)}</td><td>{e(flag)}</td>" for loss, flag in cells)
        body.append(f"<tr{mark}><td>{step}</td>{tds}</tr>")
    parts.append(f"<table><tr><th>step</th>{cols}</tr>{''.join(body)}</table>")
    for step, vals in amax_around(pm):
        parts.append(
            f"<p>Output amax (rank {pm.first_rank}, sampled step {step}): "
            + e(", ".join(f"{m} {v:.4g}" for m, v in vals))
            + "</p>"
        )
    spikes = [(r, s) for r, d in pm.ranks.items() for s in d.get("spikes") or []]
    if spikes:
        items = "".join(
            f"<li>rank {r}, step {s['step']}: loss {_num(s.get('loss'))} (bound "
            f"{_num(s.get('bound'))}, level {_num(s.get('level'))}), {e(str(s.get('action')))}"
            "</li>"
            for r, s in spikes
        )
        parts.append(f"<p>Spikes recorded:</p><ul>{items}</ul>")
    parts.append(
        "<p>The cause: <code>ampguard.autopsy(guard)</code> on the live Guard, or "
        f"<code>ampguard postmortem {e(str(run.run_dir))} --autopsy</code>.</p>"
    )
    return "".join(parts)


def _num(v: Any) -> str:
    return "-" if v is None else html.escape(f"{v:.4g}")
