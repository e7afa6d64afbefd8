"""The fp8 section of a run report: converted and kept layers, and per layer the last and worst
sampled amax and flushed shares (``fp8`` events of the run log, ``meta.json["fp8"]``)."""

from __future__ import annotations

import html
from typing import Any

__all__ = ["fp8_rows", "html_section", "text_lines"]

_COLS = ("input_flushed", "weight_flushed", "grad_flushed")


def fp8_rows(run: Any) -> list[tuple[str, int, dict[str, Any], dict[str, float]]]:
    """(layer, samples, last sample, worst flushed share per field) per sampled fp8 layer."""
    last: dict[str, dict[str, Any]] = {}
    worst: dict[str, dict[str, float]] = {}
    count: dict[str, int] = {}
    for ev in run.events:
        if ev.get("kind") != "fp8":
            continue
        for name, v in (ev.get("layers") or {}).items():
            last[name] = {"step": ev.get("step"), **v}
            count[name] = count.get(name, 0) + 1
            w = worst.setdefault(name, {})
            for c in _COLS:
                if v.get(c) is not None:
                    w[c] = max(w.get(c, 0.0), float(v[c]))
    return [(n, count[n], last[n], worst[n]) for n in last]


def _pct(v: Any) -> str:
    return "-" if v is None else f"{float(v):.2%}"


def _g(v: Any) -> str:
    return "-" if v is None else f"{float(v):.3g}"


def _head(run: Any) -> str | None:
    info = run.meta.get("fp8")
    if not info:
        return None
    mode = "emulated (no fp8 matmul on this device)" if info.get("emulated") else "fp8 matmuls"
    kept = ", ".join(n or "(root)" for n in info.get("kept_bf16", [])) or "none"
    return (
        f"fp8 ({info.get('recipe')}, {mode}): {len(info.get('converted', []))} Linear "
        f"layer(s) in fp8; kept in bf16: {kept}"
    )


def html_section(run: Any) -> str:
    """The report's fp8 section ("" when the run was not in fp8)."""
    head = _head(run)
    if head is None:
        return ""
    e = html.escape
    rows = []
    for name, n, last, worst in fp8_rows(run):
        cells = (
            name or "(root)",
            n,
            _g(last.get("input_amax")),
            _pct(last.get("input_flushed")),
            _g(last.get("weight_amax")),
            _pct(last.get("weight_flushed")),
            _g(last.get("grad_amax")),
            _pct(last.get("grad_flushed")),
            " / ".join(_pct(worst.get(c)) for c in _COLS),
        )
        rows.append("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in cells) + "</tr>")
    table = (
        (
            "<table><tr><th>layer</th><th>samples</th><th>input amax</th><th>input flushed</th>"
            "<th>weight amax</th><th>weight flushed</th><th>grad amax</th><th>grad flushed</th>"
            "<th>worst flushed (input / weight / grad)</th></tr>" + "".join(rows) + "</table>"
        )
        if rows
        else "<p>No fp8 samples (telemetry range_every=0 or too few steps).</p>"
    )
    moved = "".join(f"<p>{e(line)}</p>" for line in rescue_lines(run))
    return f"<h2>fp8 layers</h2><p>{e(head)}</p>{moved}{table}"


def rescue_lines(run: Any) -> list[str]:
    """One line per fp8 layer the Guard moved back to bf16 during training (AG113)."""
    out = []
    for ev in run.events:
        if not isinstance(ev, dict) or ev.get("kind") != "fp8_rescue":
            continue
        field, value, limit = ev.get("field"), ev.get("value"), ev.get("limit")
        if not isinstance(field, str) or not isinstance(ev.get("module"), str):
            continue
        what = field.split("_")[0].replace("grad", "output gradient")
        out.append(
            f"{ev['module']}: moved to bf16 at step {ev.get('step')} ({what} flushed "
            f"{_pct(value)}, limit {_pct(limit)})"
        )
    return out


def text_lines(run: Any) -> list[str]:
    """The fp8 lines of the plain-text summary ([] when the run was not in fp8)."""
    head = _head(run)
    if head is None:
        return []
    out = [head, *(f"  {line}" for line in rescue_lines(run))]
    for name, n, _last, worst in fp8_rows(run):
        out.append(
            f"  {name or '(root)'}: {n} samples, worst flushed input "
            f"{_pct(worst.get('input_flushed'))}, weight {_pct(worst.get('weight_flushed'))}"
            f", gradient {_pct(worst.get('grad_flushed'))}"
        )
    return out
