"""AG212: a GradScaler built, or ``scaler.scale`` called, in no-grad or evaluation code."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._context import grad_disabled, is_eval_function
from ampguard.lint._names import dotted
from ampguard.lint.rules._base import Context, Rule

__all__ = ["AG212"]


def _check(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    candidates: list[tuple[ast.Call, str]] = [(c, "GradScaler()") for c in model.scaler_ctors]
    for call in model.by_terminal.get("scale", ()):
        func = call.func
        if isinstance(func, ast.Attribute) and (key := dotted(func.value)) in model.scaler_keys:
            candidates.append((call, f"{key}.scale(...)"))
    for call, what in candidates:
        if grad_disabled(model, call):
            where = "under torch.no_grad()/inference_mode()"
        elif is_eval_function(unit := model.function_of(call)):
            where = f"in evaluation code ({unit.name})"
        else:
            continue
        yield ctx.finding(
            AG212,
            call,
            f"{what} {where}: there are no gradients to scale here; loss scaling "
            "belongs to the training step",
            context=where,
        )


AG212 = Rule.from_code(
    "AG212",
    fix="compute evaluation losses without the scaler (plain loss.item() or a metric), and create "
    "and use the GradScaler only in the training step",
    triggers=("GradScaler", ".scale("),
    check=_check,
)
