"""A per-layer format recipe from a plan's measured figures, its table and its findings.

``layer_recipe`` picks, for every Linear, the lowest-precision format in which the layer is
ready under a tolerance (``max_sqnr_loss_db``), after the structural rules (first and last layer,
small layers); ``recipe_table`` prints the per-format verdicts and the choice; ``recipe_findings``
explains each layer kept in higher precision than the lowest format measured:

AG347 info      a layer the recipe keeps in higher precision, and why (the figure or the rule)
AG348 info      the recipe: how many layers in each format
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ampguard._util.checks import check_bool, is_int, is_number
from ampguard.findings import Finding, make
from ampguard.fp8._formats import FORMATS
from ampguard.fp8._multi import _problem

__all__ = ["layer_recipe", "recipe_reasons", "recipe_table", "recipe_findings", "HIGH"]

HIGH = "bf16"  # what a layer that no format suits trains in


def _candidates(plan: Any) -> list[str]:
    """Measured formats from the lowest precision up; ties keep the order of ``formats=``."""
    names = list(plan.formats) or [plan.float8_recipe]
    return sorted(names, key=lambda n: FORMATS[n].bits)  # sorted() is stable


def _ready_in(plan: Any, info: dict[str, Any], name: str, th: Any) -> bool:
    if not plan.formats:  # the fp8 plan's own verdict is the one format's
        return bool(info["ready"])
    fig = info.get("formats", {}).get(name)
    if not fig or not fig["eligible"] or "sqnr_loss_db" not in fig:
        return False
    return _problem(fig, FORMATS[name], th) is None


def recipe_reasons(
    plan: Any, max_sqnr_loss_db: float | None, keep_first_last: bool, min_features: int
) -> dict[str, tuple[str, str]]:
    """``{layer: (format, why)}``: the choice and the reason in words."""
    if max_sqnr_loss_db is not None and not (
        is_number(max_sqnr_loss_db) and max_sqnr_loss_db >= 0
    ):  # a string, a bool (True is not 1 dB) or NaN
        raise ValueError(
            f"max_sqnr_loss_db must be a number >= 0 (dB) or None, got {max_sqnr_loss_db!r}"
        )
    check_bool("keep_first_last", keep_first_last)
    if not is_int(min_features) or min_features < 0:
        raise ValueError(f"min_features must be an int >= 0, got {min_features!r}")
    th = plan.thresholds
    if max_sqnr_loss_db is not None:
        th = dataclasses.replace(th, max_sqnr_loss_db=float(max_sqnr_loss_db))
    ends = {plan.order[0], plan.order[-1]} if keep_first_last and plan.order else set()
    out: dict[str, tuple[str, str]] = {}
    for name, info in plan.layers.items():
        fin, fout = info["shape"]
        if name not in plan.order:
            out[name] = (HIGH, "not called in the traced forward: nothing measured")
        elif name in ends:
            where = "first" if name == plan.order[0] else "last"
            out[name] = (HIGH, f"the {where} Linear layer (keep_first_last=True)")
        elif min(fin, fout) < min_features:
            out[name] = (HIGH, f"small ({fin}x{fout} < min_features={min_features})")
        else:
            out[name] = _choose(plan, info, th)
    return out


def _choose(plan: Any, info: dict[str, Any], th: Any) -> tuple[str, str]:
    tried: list[str] = []
    for fmt in _candidates(plan):
        if _ready_in(plan, info, fmt, th):
            skipped = f" ({'; '.join(tried)})" if tried else ""
            return fmt, f"lowest precision within tolerance{skipped}"
        reason = info.get("formats", {}).get(fmt, {}).get("reason") or info["reason"]
        tried.append(f"{fmt}: {reason}")
    return HIGH, "; ".join(tried) or "no format measured"


def layer_recipe(
    plan: Any, max_sqnr_loss_db: float | None, keep_first_last: bool, min_features: int
) -> dict[str, str]:
    """``{layer: format}`` (see :meth:`ampguard.Fp8Plan.recipe`)."""
    reasons = recipe_reasons(plan, max_sqnr_loss_db, keep_first_last, min_features)
    return {name: fmt for name, (fmt, _) in reasons.items()}


def _cell(fig: dict[str, Any] | None) -> str:
    if not fig:
        return "-"
    if not fig["eligible"]:
        return "shape"
    if "sqnr_db" not in fig:
        return "unused"
    mark = "ok" if fig["ready"] else "no"
    return f"{fig['sqnr_db']:.1f} dB {mark}"


def recipe_table(plan: Any, **options: Any) -> str:
    """One row per Linear: each format's output SQNR and verdict, then the recipe's choice."""
    reasons = recipe_reasons(plan, options.get("max_sqnr_loss_db"),
                             options.get("keep_first_last", True),
                             options.get("min_features", 64))  # fmt: skip
    head = ["layer", "in x out", *plan.formats, "recipe"]
    rows = [head]
    for name, info in plan.layers.items():
        cells = [_cell(info.get("formats", {}).get(f)) for f in plan.formats]
        rows.append([name or "(root)", "x".join(map(str, info["shape"])), *cells, reasons[name][0]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    counts: dict[str, int] = {}
    for fmt, _ in reasons.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    tally = ", ".join(f"{n} {fmt}" for fmt, n in counts.items())
    tol = options.get("max_sqnr_loss_db")
    tol = plan.thresholds.max_sqnr_loss_db if tol is None else tol
    lines.append(f"recipe (SQNR loss within {tol:g} dB of each format's nominal): {tally}")
    return "\n".join(lines)


def recipe_findings(plan: Any) -> list[Finding]:
    """AG348 (the recipe) and one AG347 per layer kept higher than the lowest format."""
    if not plan.formats:
        return []
    reasons = recipe_reasons(plan, None, True, 64)
    lowest = _candidates(plan)[0]
    found = []
    counts: dict[str, list[str]] = {}
    for name, (fmt, why) in reasons.items():
        counts.setdefault(fmt, []).append(name)
        if fmt != lowest:
            found.append(
                make(
                    "AG347",
                    message=f"{name or '(root)'}: {fmt}, not {lowest}: {why}",
                    evidence={"layer": name, "format": fmt, "lowest": lowest, "why": why},
                )
            )
    tally = "; ".join(f"{fmt}: {', '.join(n or '(root)' for n in names)}"
                      for fmt, names in counts.items())  # fmt: skip
    found.insert(
        0,
        make(
            "AG348",
            message=f"per-layer formats (measured: {', '.join(plan.formats)}): {tally}",
            evidence={"recipe": {n: f for n, (f, _) in reasons.items()}},
        ),
    )
    return found
