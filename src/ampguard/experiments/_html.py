"""``Comparison.save``: comparison.json and a self-contained comparison.html (plots as base64 PNG).

The page opens offline: no scripts, no external assets. Plots are drawn with matplotlib's
object API (``Figure`` + Agg canvas), so nothing touches pyplot's global state. Without
matplotlib the page is written without plots and says so.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any

from ampguard import precisions
from ampguard._util.atomic import write_text

__all__ = ["write_report", "plots"]

_COLORS = {
    "fp32": "#222222",
    "fp16_dynamic": "#1f77b4",
    "fp16_fixed": "#2ca02c",
    "bf16": "#9467bd",
    "fp16_noscaler": "#d62728",
}
_VERDICT_COLORS = {
    "amp_ok": "#e6f4ea",
    "dynamic_scale_conflict": "#fff4e5",
    "fp16_range": "#fde8e8",
    "model_problem": "#fde8e8",
    "fp8_ok": "#e6f4ea",
    "fp8_keep_layers": "#fff4e5",
    "fp8_fails": "#fde8e8",
}
_CSS = """body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:right}th{background:#f4f4f4}.t{text-align:left}
.verdict{padding:1em;border-radius:6px;margin:1em 0}.no{color:#b00020;font-weight:600}
code,pre{background:#f6f6f6;padding:2px 4px;white-space:pre-wrap}img{max-width:100%}"""


def _png(fig: Any) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plots(cmp: Any) -> dict[str, str]:
    """Base64 PNGs: ``loss`` (curves of every variant) and ``deviation`` (|rel. dev.| vs fp32).

    Non-finite losses are marked with x and skipped steps with | along the top edge.
    Raises ImportError without matplotlib.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    reference = precisions.full()  # the baseline variant: autocast off
    base = cmp.variants[reference].losses
    positive = all(x > 0 for r in cmp.variants.values() for x in r.losses if math.isfinite(x))
    loss_fig, dev_fig = Figure(figsize=(9, 4)), Figure(figsize=(9, 3.2))
    ax, dx = loss_fig.add_subplot(), dev_fig.add_subplot()
    for k, (name, r) in enumerate(cmp.variants.items()):
        style: dict[str, Any] = {
            "color": _COLORS.get(name),
            "lw": 2.2 if name == reference else 1.2,
            "ls": "-" if name == reference else (0, (4, 1 + k)),
        }
        ax.plot(
            range(1, len(r.losses) + 1),
            [x if math.isfinite(x) else math.nan for x in r.losses],
            label=name,
            **style,
        )
        _marks(ax, r, k, style["color"])
        if name != reference:
            dev = [
                abs(x - b) / max(abs(b), 1e-12)
                if math.isfinite(x) and math.isfinite(b)
                else math.nan
                for x, b in zip(r.losses, base, strict=False)
            ]
            dx.plot(
                range(1, len(dev) + 1), [d if d > 0 else math.nan for d in dev], label=name, **style
            )
    ax.set(
        xlabel="step",
        ylabel="loss",
        title="Loss per variant (same weights and data; x: non-finite, |: skipped)",
    )
    dx.set(xlabel="step", ylabel="|loss - fp32| / |fp32|", title="Deviation from fp32")
    if positive:
        ax.set_yscale("log")
    dx.set_yscale("log")
    for a in (ax, dx):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    return {"loss": _png(loss_fig), "deviation": _png(dev_fig)}


def _marks(ax: Any, r: Any, k: int, color: str | None) -> None:
    """Non-finite losses (x) and skipped steps (|) in a strip per variant along the top."""
    y = 0.97 - 0.035 * k
    bad = [i + 1 for i, x in enumerate(r.losses) if not math.isfinite(x)]
    trans = ax.get_xaxis_transform()  # x in data, y in axes coordinates
    if bad:
        ax.plot(bad, [y] * len(bad), "x", color=color, ms=5, transform=trans)
    skipped = [s for s in r.skipped_at if s not in set(bad)]
    if skipped:
        ax.plot(skipped, [y] * len(skipped), "|", color=color, ms=7, transform=trans)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _table(cmp: Any) -> str:
    head = (
        "variant",
        "what",
        "trained",
        "why",
        "skipped",
        "final scale",
        "max rel. dev.",
        "throughput vs fp32",
    )
    rows = []
    for r in cmp.variants.values():
        trained = "yes" if r.trained else '<span class="no">no</span>'
        cells = (
            html.escape(r.name),
            html.escape(r.description),
            trained,
            html.escape(
                r.reason + (f" ({r.error})" if r.error and r.error not in r.reason else "")
            ),
            str(r.skipped),
            _fmt(r.final_scale, "g"),
            _fmt(r.max_rel_dev, ".3g"),
            f"{r.throughput_ratio:.2f}x",
        )
        rows.append(
            "<tr>"
            + "".join(
                f"<td{' class=t' if i in (0, 1, 3) else ''}>{c}</td>" for i, c in enumerate(cells)
            )
            + "</tr>"
        )
    return (
        "<table><tr>"
        + "".join(f"<th{' class=t' if i in (0, 1, 3) else ''}>{h}</th>" for i, h in enumerate(head))
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


def render(cmp: Any) -> str:
    """The comparison as one self-contained HTML page."""
    finding = cmp.finding()
    try:
        images = plots(cmp)
        figs = "".join(
            f'<p><img alt="{k}" src="data:image/png;base64,{v}"></p>' for k, v in images.items()
        )
    except ImportError:
        figs = "<p>Plots need matplotlib: <code>pip install 'ampguard[report]'</code>.</p>"
    diag = ""
    if cmp.failing_batch is not None:
        from ampguard.experiments._verdict import explain

        text = explain(cmp.diagnosis) or cmp.locate_error or "no diagnosis"
        diag = f"<h2>First failing batch: #{cmp.failing_batch}</h2><pre>{html.escape(text)}</pre>"
    fix = f"<p><b>Fix:</b> <code>{html.escape(cmp.fix)}</code></p>" if cmp.fix else ""
    bg = _VERDICT_COLORS[cmp.verdict]
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>ampguard compare: {cmp.verdict}</title><style>{_CSS}</style></head><body>"
        f"<h1>ampguard A/B comparison</h1><p>{cmp.steps} steps per variant.</p>"
        f'<div class="verdict" style="background:{bg}"><h2>Verdict: {cmp.verdict} '
        f"({finding.code})</h2><p>{html.escape(cmp.explanation)}</p>{fix}</div>"
        f"{_table(cmp)}{figs}{diag}</body></html>"
    )


def write_report(cmp: Any, directory: Path) -> Path:
    """Write ``comparison.json`` and ``comparison.html`` atomically; return the HTML path."""
    directory.mkdir(parents=True, exist_ok=True)
    data = json.dumps(cmp.to_dict(), indent=2, allow_nan=False)
    write_text(directory / "comparison.json", data)
    page = directory / "comparison.html"
    write_text(page, render(cmp))
    return page
