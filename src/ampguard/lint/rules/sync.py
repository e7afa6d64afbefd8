"""AG213: a host sync on every training step whose value is only logged.

Syncs: ``x.item()``, ``scaler.get_scale()`` and a device tensor formatted as text (``f"{loss}"``,
``str(loss)``, ``print(loss)``). Logged: printed, passed to a logger or progress bar, fed to a
running-average meter, or summed into a total that the step itself reads only to log.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._context import is_scheduler_like
from ampguard.lint._model import FUNCS, branch_of
from ampguard.lint._names import dotted, terminal
from ampguard.lint.rules._base import Context, Rule
from ampguard.lint.rules._tensors import formatted_tensors

__all__ = ["AG213"]

_LOG_METHODS = frozenset(
    {
        "info",
        "debug",
        "warning",
        "warn",
        "error",
        "critical",
        "exception",
        "log",
        "log_metric",
        "log_metrics",
        "add_scalar",
        "add_scalars",
        "set_postfix",
        "set_postfix_str",
        "set_description",
        "write",
    }
)
_METER_WORDS = ("meter", "metric", "smooth", "logger", "tracker", "averager", "running_avg")
_METER_CLASSES = ("Meter", "MetricLogger", "SmoothedValue", "Averager", "Tracker", "RunningAverage")
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_STOP = (*FUNCS, ast.Lambda, ast.ClassDef)


def _check(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    for node, what in _syncs(ctx):
        found = _per_step(ctx, node)
        if found is None or not _only_logged(ctx, node, found[1]):
            continue
        if len(what) > 40:
            what = what[:37] + "..."
        yield ctx.finding(
            AG213,
            node,
            f"{what} runs on every training step ({found[0]}) only to be logged: "
            "each call waits for the device (a host sync); log every N steps or accumulate on "
            "the device",
            sync=what,
            unit=unit.name if (unit := model.function_of(node)) is not None else "<module>",
        )


def _syncs(ctx: Context) -> Iterator[tuple[ast.AST, str]]:
    """Host syncs: ``x.item()``, ``scaler.get_scale()``, and a device tensor formatted as text."""
    model = ctx.model
    for call in model.by_terminal.get("item", ()):
        if isinstance(call.func, ast.Attribute) and not call.args and not call.keywords:
            yield call, ast.unparse(call)
    for call in model.by_terminal.get("get_scale", ()):
        if isinstance(call.func, ast.Attribute) and dotted(call.func.value) in model.scaler_keys:
            yield call, ast.unparse(call)
    yield from formatted_tensors(model)


def _per_step(ctx: Context, node: ast.AST) -> tuple[str, ast.AST] | None:
    """Where ``node`` runs once per step (``loop at line N`` / ``training_step``, and that loop or
    function), else ``None``."""
    child: ast.AST = node
    for anc in ctx.model.ancestors(node):
        if branch_of(anc, child) is not None:
            return None  # conditional: already throttled (or at least not every step)
        if isinstance(anc, _LOOPS):
            if not any(s is child for s in anc.body) or not _trains(ctx, anc.body, 0):
                return None
            return f"loop at line {anc.lineno}", anc
        if isinstance(anc, _STOP):
            if isinstance(anc, FUNCS) and anc.name == "training_step":
                return "training_step", anc
            return None
        if isinstance(anc, ast.withitem) or (
            isinstance(anc, (ast.If, ast.While)) and child is anc.test
        ):
            return None
        child = anc
    return None


def _trains(ctx: Context, body: list[ast.stmt], depth: int) -> bool:
    """``body`` (not its nested loops) runs backward() or an optimizer/scaler step."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, _STOP) or (depth == 0 and isinstance(node, _LOOPS)):
            continue
        if isinstance(node, ast.Call) and _training_call(ctx, node, depth):
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def _training_call(ctx: Context, call: ast.Call, depth: int) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        if func.attr == "backward":
            return True
        if (
            func.attr == "step"
            and dotted(func.value) is not None
            and not is_scheduler_like(ctx.model, func.value)
        ):
            return True
    if depth >= 2 or not isinstance(func, ast.Name):
        return False
    found = ctx.model.binding(func.id, ctx.model.scope_of(call))
    if found and found[0] == "values" and len(found[1]) == 1 and isinstance(found[1][0], FUNCS):
        return _trains(ctx, found[1][0].body, depth + 1)
    return False


def _is_log_call(ctx: Context, node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "print"
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "update":
        return (bool(node.args) or bool(node.keywords)) and _is_meter(ctx, func.value)
    return func.attr in _LOG_METHODS


def _is_meter(ctx: Context, recv: ast.AST) -> bool:
    """A running-average sink: MetricLogger, SmoothedValue, AverageMeter and the like."""
    if isinstance(recv, ast.Subscript):  # meters["loss"].update(...)
        recv = recv.value
    key = dotted(recv)
    if key is None:
        return False
    last = key.rsplit(".", 1)[-1].lower()
    if any(word in last for word in _METER_WORDS):
        return True
    values, _ = ctx.model.values_of(recv)
    return any(
        isinstance(v, ast.Call) and (terminal(v.func) or "").endswith(_METER_CLASSES)
        for v in values
    )


def _only_logged(ctx: Context, node: ast.AST, where: ast.AST) -> bool:
    """The value goes straight into a logging call, into a name used only by logging calls, or
    into a running total (``epoch_loss += loss.item()``) that the step reads only to log it."""
    model = ctx.model
    child: ast.AST = node
    anc: ast.AST = node
    for anc in model.ancestors(node):
        if isinstance(anc, ast.Call) and _is_log_call(ctx, anc) and child is not anc.func:
            return True
        if isinstance(anc, ast.stmt):
            break
        child = anc
    stmt = anc
    if isinstance(stmt, ast.AugAssign) and child is stmt.value:
        key = dotted(stmt.target)
        body = where.body if isinstance(where, _LOOPS) else [where]
        uses = [
            n
            for n in model.statements(body)
            if n is not stmt.target
            and isinstance(n, (ast.Name, ast.Attribute))
            and isinstance(n.ctx, ast.Load)
            and dotted(n) == key
        ]
        return key is not None and all(_inside_log(ctx, n) for n in uses)
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
    ):
        return False
    name = stmt.targets[0].id
    unit = model.function_of(node)
    body = unit.body if unit is not None else model.tree.body
    uses = [
        n
        for n in model.statements(body)
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
    ]
    return bool(uses) and all(_inside_log(ctx, n) for n in uses)


def _inside_log(ctx: Context, node: ast.AST) -> bool:
    child = node
    for anc in ctx.model.ancestors(node):
        if isinstance(anc, ast.Call) and _is_log_call(ctx, anc) and child is not anc.func:
            return True
        if isinstance(anc, ast.stmt):
            return False
        child = anc
    return False


AG213 = Rule.from_code(
    "AG213",
    fix="log every N steps (if step % N == 0: print(loss.item())), or accumulate on the device "
    "(running += loss.detach()) and read it once per N steps",
    triggers=(".item()", "get_scale", ".backward("),
    check=_check,
)
