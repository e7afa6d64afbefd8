"""Which function bodies the order-sensitive rules interpret (shared, cached per file)."""

from __future__ import annotations

import ast

from ampguard.lint._flow import Events
from ampguard.lint._model import FUNCS
from ampguard.lint.rules._base import Context

__all__ = ["events", "flow_units"]

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
