"""AG207: an LR scheduler stepped unconditionally right after ``scaler.step(...)``."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._context import is_scheduler_like
from ampguard.lint._model import FUNCS
from ampguard.lint._names import dotted
from ampguard.lint.rules._base import Context, Rule

__all__ = ["AG207"]

_BOUNDARY = (*FUNCS, ast.Lambda, ast.ClassDef, ast.For, ast.AsyncFor, ast.While, ast.Module)
_LISTS = ("body", "orelse", "finalbody")


def _check(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    seen: set[int] = set()
    for call in model.by_terminal.get("step", ()):
        func = call.func
        if not (
            isinstance(func, ast.Attribute)
            and call.args
            and dotted(func.value) in model.scaler_keys
        ):
            continue
        for sched, name in _later_scheduler_steps(ctx, call):
            if id(sched) not in seen:
                seen.add(id(sched))
                yield ctx.finding(
                    AG207,
                    sched,
                    f"{name}.step() runs even when {dotted(func.value)}.step() "
                    "skipped the optimizer step (inf/NaN gradients): the schedule advances "
                    "without training",
                    scheduler=name,
                    step_line=call.lineno,
                )


def _later_scheduler_steps(ctx: Context, call: ast.Call) -> Iterator[tuple[ast.Call, str | None]]:
    """Scheduler ``.step()`` statements after the one holding ``call``, at each block level."""
    child: ast.AST = call
    for anc in ctx.model.ancestors(call):
        if isinstance(child, ast.stmt):
            for field in _LISTS:
                block = getattr(anc, field, None)
                if isinstance(block, list) and any(s is child for s in block):
                    index = next(i for i, s in enumerate(block) if s is child)
                    yield from _scheduler_steps(ctx, block[index + 1 :])
        if isinstance(anc, _BOUNDARY):
            return
        child = anc


def _scheduler_steps(ctx: Context, stmts: list[ast.stmt]) -> Iterator[tuple[ast.Call, str | None]]:
    """Scheduler ``.step()`` calls among ``stmts``, each with the scheduler's text."""
    for stmt in stmts:
        value = stmt.value if isinstance(stmt, ast.Expr) else None
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "step"
            and not value.args
            and not value.keywords
            and dotted(value.func.value) not in ctx.model.scaler_keys
            and is_scheduler_like(ctx.model, value.func.value)
        ):
            yield value, dotted(value.func.value)


AG207 = Rule.from_code(
    "AG207",
    fix="step the scheduler only when the optimizer stepped, e.g. compare scaler.get_scale() "
    "before and after scaler.update() (a lower scale means the step was skipped), or use "
    "ampguard's Guard, whose StepResult.applied says so",
    triggers=("caler", "unscale_", ".scale("),
    check=_check,
)
