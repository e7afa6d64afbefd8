"""AG207: an LR scheduler stepped right after ``scaler.step(...)`` whether or not it skipped.

Also under an ``if`` that does not ask whether the optimizer stepped: ``if sched is not None:``,
``if cfg.per_iter_sched:``, ``if (i + 1) % accum == 0:`` test configuration or the step count, so
the schedule still advances on a skipped step. An ``if`` is a gate (silent) when its test calls
something (``scaler.get_scale() >= before``), reads a name the loop assigns
(``optimizer_was_run = ...``, a counter), or names a skip (``skipped``, ``applied``,
``found_inf``, ``overflow``, ...).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._context import is_scheduler_like
from ampguard.lint._model import FUNCS
from ampguard.lint._names import dotted
from ampguard.lint._tree import walk
from ampguard.lint.rules._base import Context, Rule

__all__ = ["AG207"]

_BOUNDARY = (*FUNCS, ast.Lambda, ast.ClassDef, ast.For, ast.AsyncFor, ast.While, ast.Module)
_LISTS = ("body", "orelse", "finalbody")
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_GATE_WORDS = frozenset(
    {
        "skip",
        "skipped",
        "applied",
        "stepped",
        "run",
        "overflow",
        "overflowed",
        "inf",
        "nan",
        "finite",
        "nonfinite",
        "valid",
        "success",
        "ok",
        "updated",
    }
)


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
        assigned = _loop_assigned(ctx, call)
        for sched, name, test in _later_scheduler_steps(ctx, call, assigned):
            if id(sched) not in seen:
                seen.add(id(sched))
                under = f" (under 'if {test}', which does not test the step)" if test else ""
                yield ctx.finding(
                    AG207,
                    sched,
                    f"{name}.step() runs even when {dotted(func.value)}.step() "
                    f"skipped the optimizer step (inf/NaN gradients){under}: the schedule "
                    "advances without training",
                    scheduler=name,
                    step_line=call.lineno,
                )


_Found = tuple[ast.Call, str | None, str | None]


def _loop_assigned(ctx: Context, call: ast.Call) -> frozenset[str]:
    """Names that may hold whether the step ran: any name assigned in the body of the loop
    around ``call`` (not its own ``for`` target); in a function body (a step helper), a name
    assigned a gate (``stepped = before <= scaler.get_scale()``), wherever it is assigned."""
    loop = next((a for a in ctx.model.ancestors(call) if isinstance(a, (*_LOOPS, *FUNCS))), None)
    if loop is None:
        return frozenset()
    out = set()
    if isinstance(loop, _LOOPS):
        for node in ctx.model.statements(loop.body):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
        return frozenset(out)
    for node in ctx.model.statements(loop.body):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if _is_gate(node.value, frozenset()):
                out.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(out)


# calls in a test that only look at a value's type or shape: they never ask whether a step ran
_TYPE_TESTS = frozenset(
    {"isinstance", "issubclass", "hasattr", "callable", "type", "len", "getattr", "id"}
)


def _is_gate(test: ast.AST, assigned: frozenset[str]) -> bool:
    """``test`` may ask whether the optimizer stepped (see the module docstring); a type test
    (``isinstance(sched, ReduceLROnPlateau)``, ``hasattr(...)``) does not."""
    for node in walk(test):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in _TYPE_TESTS:
                continue  # its arguments are still read (a gate name passed in is a gate)
            return True
        if isinstance(node, (ast.Await, ast.NamedExpr)):
            return True
        word = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if not isinstance(word, str):
            continue
        if isinstance(node, ast.Name) and word in assigned:
            return True
        if not _GATE_WORDS.isdisjoint(word.lower().split("_")):
            return True
    return False


def _later_scheduler_steps(
    ctx: Context, call: ast.Call, assigned: frozenset[str]
) -> Iterator[_Found]:
    """Scheduler ``.step()`` statements after the one holding ``call``, at each block level."""
    child: ast.AST = call
    for anc in ctx.model.ancestors(call):
        if isinstance(child, ast.stmt):
            for field in _LISTS:
                block = getattr(anc, field, None)
                if isinstance(block, list) and any(s is child for s in block):
                    index = next(i for i, s in enumerate(block) if s is child)
                    yield from _scheduler_steps(ctx, block[index + 1 :], assigned, None)
        if isinstance(anc, _BOUNDARY):
            return
        child = anc


def _scheduler_steps(
    ctx: Context, stmts: list[ast.stmt], assigned: frozenset[str], test: str | None
) -> Iterator[_Found]:
    """Scheduler ``.step()`` calls among ``stmts`` (also inside ``if`` statements that are not a
    gate), each with the scheduler's text and the test it runs under."""
    for stmt in stmts:
        if isinstance(stmt, ast.If) and not _is_gate(stmt.test, assigned):
            text = ast.unparse(stmt.test)
            text = text if len(text) <= 40 else text[:37] + "..."
            yield from _scheduler_steps(ctx, stmt.body, assigned, test or text)
            yield from _scheduler_steps(ctx, stmt.orelse, assigned, test or f"not ({text})")
            continue
        value = stmt.value if isinstance(stmt, ast.Expr) else None
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "step"
            and not value.args
            and not value.keywords
            and dotted(value.func.value) not in ctx.model.scaler_keys
        ):
            name = _scheduler_text(ctx, value.func.value)
            if name is not None:
                yield value, name, test


def _scheduler_text(ctx: Context, expr: ast.AST) -> str | None:
    """How the source names the scheduler ``expr`` holds (``None``: not a scheduler): a name
    or attribute (by name or by what built it), or a subscript whose keys say so
    (``op_sc['scheduler']['module']``, ``self.schedulers[0]``)."""
    if dotted(expr) is not None:
        return dotted(expr) if is_scheduler_like(ctx.model, expr) else None
    node, words = expr, []
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        if isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            words.append(node.slice.value)
        node = node.value
    if isinstance(node, ast.Name):
        words.append(node.id)
    if any("sched" in word.lower() for word in words):
        return ast.unparse(expr)
    return None


AG207 = Rule.from_code(
    "AG207",
    fix="step the scheduler only when the optimizer stepped, e.g. compare scaler.get_scale() "
    "before and after scaler.update() (a lower scale means the step was skipped), or use "
    "ampguard's Guard, whose StepResult.applied says so",
    triggers=("caler", "unscale_", ".scale("),
    check=_check,
)
