"""Text and findings for :class:`ampguard.Fp8Plan`: the table and the AG340-AG346 codes.

AG340 info      layers ready for fp8 (fix: fine, convert them)
AG341 warning   outlier features: a layer's input flushes in e4m3 (fix: keep in bf16 or rowwise)
AG342 warning   the output gradient flushes in fp8 (fix: rescale, or keep in bf16)
AG343 warning   the layer's fp8 output is too noisy (SQNR below the limit)
AG344 warning   the weight flushes in e4m3
AG345 info      a shape fp8 matmuls do not accept (fix: keep in bf16, or pad to multiples of 16)
AG346 info      a Linear the traced forward never called (kept in bf16)
AG355 warning   matmul modules that are not nn.Linear (transformers Conv1D, ...): they stay in
                bf16 (fix: ag.conv1d_to_linear for Conv1D)
"""

from __future__ import annotations

import math
from typing import Any

from ampguard.findings import Finding, make

__all__ = ["plan_table", "plan_findings", "FIX_TEXT"]

FIX_TEXT = {
    "fine": "fine: train it in fp8",
    "keep_bf16": "keep it in bf16 (the plan's module_filter_fn leaves it out)",
    "rowwise": "train it in fp8 with recipe='rowwise' (per-row scales absorb the outliers), "
    "or keep it in bf16",
    "rescale": "rescale: bring the loss terms or activations that feed this gradient to "
    "comparable magnitudes (or recipe='rowwise'); until then keep it in bf16",
}

_CODES = {  # problem -> code (title and severity: ampguard.findings.codes.CATALOGUE)
    "input": "AG341",
    "grad": "AG342",
    "sqnr": "AG343",
    "weight": "AG344",
    "shape": "AG345",
    "unused": "AG346",
}


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.2%}"


def _db(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "inf" if math.isinf(v) else f"{v:.1f}"


def plan_table(plan: Any) -> str:
    """One row per Linear layer: shape, eligible, SQNR, flushed shares, ready, fix, reason."""
    rows = [
        (
            "layer",
            "in x out",
            "eligible",
            "SQNR dB",
            "input flushed",
            "grad flushed",
            "ready",
            "fix",
        )
    ]
    for name, info in plan.layers.items():
        i, o = info["shape"]
        rows.append(
            (
                name or "(root)",
                f"{i}x{o}",
                "yes" if info["eligible"] else "no",
                _db(info["sqnr_db"]),
                _pct(info["input_flushed"]),
                _pct(info["grad_flushed"]),
                "yes" if info["ready"] else "NO",
                info["fix"],
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    n_ready = len(plan.ready_layers)
    lines.append("")
    lines.append(
        f"fp8 plan ({plan.float8_recipe}): {n_ready} of {len(plan.layers)} Linear layers "
        f"ready; {plan.seconds * 1e3:.0f} ms"
    )
    for name, info in plan.layers.items():
        if not info["ready"]:
            lines.append(f"  {name or '(root)'}: {info['reason']}")
    if plan.formats:
        from ampguard.fp8._recipe import recipe_table

        lines += ["", recipe_table(plan)]
    lines.extend(_unconvertible_lines(plan))
    return "\n".join(lines)


def _unconvertible_lines(plan: Any) -> list[str]:
    others = plan.unconvertible
    if not others:
        return []
    by_type: dict[str, list[str]] = {}
    for name, info in others.items():
        by_type.setdefault(info["type"], []).append(name or "(root)")
    lines = [
        f"{len(others)} more module(s) do matmuls but are not nn.Linear, so fp8 cannot convert "
        "them (they stay in bf16):"
    ]
    for kind, names in by_type.items():
        fix = next(i["fix"] for i in others.values() if i["type"] == kind)
        lines.append(f"  {kind} ({len(names)}): {', '.join(names)}")
        lines.append(f"    fix: {fix}")
    return lines


def plan_findings(plan: Any) -> list[Finding]:
    """AG341-AG346 for every layer the plan keeps out of fp8, then AG340 for the ready ones."""
    out = []
    for name, info in plan.layers.items():
        if info["ready"]:
            continue
        label = name or "(root)"
        skip = ("reason", "ready", "problem", "formats")
        evidence = {k: v for k, v in info.items() if k not in skip}
        evidence["layer"] = label
        evidence["recipe"] = plan.float8_recipe
        out.append(
            make(
                _CODES[info["problem"]],
                f"{label}: {info['reason']}",
                evidence=evidence,
                fix=f"{label}: {FIX_TEXT[info['fix']]}",
            )
        )
    if plan.unconvertible:
        out.append(_unconvertible_finding(plan))
    ready = plan.ready_layers
    if ready:
        out.append(
            make(
                "AG340",
                f"{len(ready)} of {len(plan.layers)} Linear layers are ready for fp8 "
                f"({plan.float8_recipe}): {', '.join(n or '(root)' for n in ready)}",
                evidence={"ready": ready, "recipe": plan.float8_recipe},
                fix="fine: ag.Guard(model, optimizer, precision='fp8', fp8_plan=plan), or "
                "convert_to_float8_training(model, module_filter_fn=plan.module_filter_fn)",
            )
        )
    from ampguard.fp8._recipe import recipe_findings

    return out + recipe_findings(plan)


def _unconvertible_finding(plan: Any) -> Finding:
    others = plan.unconvertible
    kinds = sorted({i["type"] for i in others.values()})
    names = list(others)
    fixes = []
    for kind in kinds:
        fix = next(i["fix"] for i in others.values() if i["type"] == kind)
        fixes.append(f"{kind}: {fix}")
    return make(
        "AG355",
        f"{len(others)} module(s) do matmuls but are not nn.Linear ({', '.join(kinds)}), so "
        f"precision='fp8' leaves them in bf16: {', '.join(n or '(root)' for n in names)}",
        evidence={
            "modules": {n or "(root)": dict(i) for n, i in others.items()},
            "types": kinds,
            "linear_layers": len(plan.layers),
        },
        fix="; ".join(fixes),
    )
