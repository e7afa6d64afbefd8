"""Which function bodies the order-sensitive rules interpret (shared, cached per file)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding, make
from ampguard.lint._flow import Events, OutOfBudget
from ampguard.lint._model import FUNCS
from ampguard.lint._paths import MAX_PATHS
from ampguard.lint.rules._base import Context

__all__ = ["budget_note", "events", "flow_units"]

_FLOW_CODES = "AG201, AG202, AG204"

_PROTOCOL = (
    "backward",
    "step",
    "update",
    "unscale_",
    "zero_grad",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grad_norm",
    "clip_grads_with_norm_",
)


def events(ctx: Context) -> Events:
    """The file's event extractor (cached)."""
    if "events" not in ctx.cache:
        ctx.cache["events"] = Events(ctx.model)
    return ctx.cache["events"]


def flow_units(ctx: Context) -> list[ast.FunctionDef | ast.AsyncFunctionDef | ast.Module]:
    """Functions (and the module) that run AMP-protocol calls directly or through local helpers."""
    if "units" in ctx.cache:
        return ctx.cache["units"]
    model = ctx.model
    units: dict[int, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module] = {}
    if model.scaler_keys:
        names: tuple[str, ...] = _PROTOCOL
        for _ in range(4):
            added = False
            for name in names:
                for call in model.by_terminal.get(name, ()):
                    unit = model.function_of(call) or model.tree
                    if id(unit) not in units:
                        units[id(unit)] = unit
                        added = True
            if not added:
                break
            names = tuple({u.name for u in units.values() if isinstance(u, FUNCS)})
    ordered = sorted(units.values(), key=lambda u: getattr(u, "lineno", 0))
    ctx.cache["units"] = ordered
    return ordered


def budget_note(ctx: Context, unit: ast.AST, error: OutOfBudget) -> Iterator[Finding]:
    """The AG200 note (info) for a unit the flow rules gave up on, once per unit and file.

    The unit's findings of the rule that ran out are dropped (a merged path could invent one);
    the note says which function was not checked, so silence is never mistaken for "clean".
    """
    noted: set[int] = ctx.cache.setdefault("budget_notes", set())
    if id(unit) in noted:
        return
    noted.add(id(unit))
    name = f"{unit.name}()" if isinstance(unit, FUNCS) else "the module's top-level code"
    line = getattr(unit, "lineno", 1)
    if error.reason == "paths":
        why = (
            f"its branches combine into more than {MAX_PATHS} sets of conditions that cannot "
            "be merged without inventing paths"
        )
    else:
        why = "it has more steps than the interpreter's budget"
    yield make(
        "AG200",
        f"{name} (line {line}) was not checked by the order rules ({_FLOW_CODES}): {why}",
        severity="info",
        title="analysis budget exceeded",
        evidence={"unit": name, "reason": error.reason, "end_line": line},
        fix="split the function (move a branch or the logging into a helper), or check its "
        "AMP step order by hand",
        path=ctx.path,
        line=line,
        col=getattr(unit, "col_offset", 0) + 1,
    )
