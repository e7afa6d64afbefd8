"""AG204: ``scaler.update()`` missing after ``scaler.step()``, or run on every micro-batch."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._flow import Env, Event, Interpreter, OutOfBudget
from ampguard.lint._names import dotted
from ampguard.lint._tree import children, walk
from ampguard.lint.rules._base import Context, Rule
from ampguard.lint.rules._units import budget_note, events, flow_units

__all__ = ["AG204"]

_Loop = ast.For | ast.AsyncFor | ast.While

_EMPTY: tuple[frozenset, frozenset] = (frozenset(), frozenset())


class _LoopAnalysis:
    """(may, must) facts over loop iterations.

    ("p", scaler, opt): ``scaler.step(opt)`` ran; ("u", scaler, opt): an ``update()`` ran after it
    (kept beside "p" so a correlated ``if amp: update()`` never yields a false finding);
    ("S"/"U"/"B", scaler): some step / update / scaled backward ran in this iteration.
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.armed = False
        self.found: dict[int, Finding] = {}

    def join(self, a: tuple, b: tuple) -> tuple:
        return a[0] | b[0], a[1] & b[1]

    def apply(self, state: tuple, event: Event, env: Env) -> tuple:
        may, must = state
        key = env.rename(event.key)
        if event.kind == "sstep":
            opt = env.rename(event.arg) or "?"
            if (
                self.armed
                and env.record
                and ("p", key, opt) in may
                and ("u", key, opt) not in may
                and ("u", key, "*") not in may
                and not self._per_optimizer(event.node, opt)
            ):
                self._missing(event.node, key)
            may = (may - {("u", key, opt)}) | {("p", key, opt), ("S", key)}
            return may, must | {("S", key)}
        if event.kind == "update":
            done = {("u", key, f[2]) for f in may if f[0] == "p" and f[1] == key}
            return may | done | {("U", key)}, must | {("U", key)}
        if event.kind == "opaque":
            return may | {("u", key, "*"), ("O", key)}, must
        if event.kind == "bwd_scaled":
            return may | {("B", key)}, must
        return state

    def _per_optimizer(self, node: ast.AST, opt: str) -> bool:
        """``for opt in optimizers: scaler.step(opt)`` steps each optimizer once."""
        head = opt.split(".", 1)[0]
        for anc in self.ctx.model.ancestors(node):
            if isinstance(anc, (ast.For, ast.AsyncFor)) and any(
                isinstance(n, ast.Name) and n.id == head for n in walk(anc.target)
            ):
                return True
        return False

    def _missing(self, node: ast.AST, key: str | None) -> None:
        if id(node) not in self.found:
            self.found[id(node)] = self.ctx.finding(
                AG204,
                node,
                f"{key}.step() runs again on the next loop iteration with no "
                f"{key}.update() in between: the loss scale never changes",
                scaler=key,
            )


def _check(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    analysis = _LoopAnalysis(ctx)
    extractor = events(ctx)
    units = {id(u) for u in flow_units(ctx)}
    for loop in model.loops:
        if id(model.function_of(loop) or model.tree) not in units:
            continue
        before = set(analysis.found)
        try:
            _loop(ctx, loop, Interpreter(extractor, analysis), analysis)
        except OutOfBudget as error:
            for key in set(analysis.found) - before:
                del analysis.found[key]
            yield from budget_note(ctx, model.function_of(loop) or model.tree, error)
    yield from analysis.found.values()
    yield from _never_updated(ctx, set(analysis.found))


def _loop(ctx: Context, loop: _Loop, interp: Interpreter, analysis: _LoopAnalysis) -> None:
    analysis.armed = False
    out, cont = interp.body(loop.body, _EMPTY, record=False)
    back = interp.join(out, cont)
    if back is None:
        return
    analysis.armed = True
    try:
        interp.body(loop.body, back, record=True)
    finally:
        analysis.armed = False
    may, must = back
    for fact in sorted(f for f in must if f[0] == "U"):
        key = fact[1]
        if ("S", key) in must or ("O", key) in may:
            continue
        if _direct_step(ctx, loop, key) or (("B", key) in may and _steps_outside(ctx, loop, key)):
            node = _first_update(ctx, loop, key)
            if node is not None and id(node) not in analysis.found:
                analysis.found[id(node)] = ctx.finding(
                    AG204,
                    node,
                    f"{key}.update() runs on every micro-batch but {key}.step() "
                    "does not (gradient accumulation): update once per optimizer step, right "
                    f"after {key}.step()",
                    scaler=key,
                )


def _direct_step(ctx: Context, loop: _Loop, key: str) -> bool:
    """``key.step(...)`` sits in ``loop``'s own body (maybe under an ``if``, not a nested loop)."""
    stack: list[ast.AST] = list(loop.body)
    while stack:
        node = stack.pop()
        if isinstance(
            node,
            (
                ast.For,
                ast.AsyncFor,
                ast.While,
                ast.FunctionDef,
                ast.AsyncFunctionDef,
                ast.Lambda,
                ast.ClassDef,
            ),
        ):
            continue
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "step"
            and dotted(node.func.value) == key
        ):
            return True
        stack.extend(children(node))
    return False


def _steps_outside(ctx: Context, loop: _Loop, key: str) -> bool:
    model = ctx.model
    unit = model.function_of(loop)
    for call in model.by_terminal.get("step", ()):
        if (
            isinstance(call.func, ast.Attribute)
            and dotted(call.func.value) == key
            and model.function_of(call) is unit
            and loop not in model.ancestors(call)
        ):
            return True
    return False


def _first_update(ctx: Context, loop: _Loop, key: str) -> ast.AST | None:
    for node in ctx.model.statements(loop.body):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and dotted(node.func.value) == key
        ):
            return node
    return None


def _never_updated(ctx: Context, already: set[int]) -> Iterator[Finding]:
    """A scaler built in this file that is stepped but never updated, passed on or returned."""
    model = ctx.model
    for key in model.ctor_targets:
        steps = [
            c
            for c in model.by_terminal.get("step", ())
            if isinstance(c.func, ast.Attribute) and dotted(c.func.value) == key and c.args
        ]
        if not steps or any(id(s) in already for s in steps):
            continue
        updates = [
            c
            for c in model.by_terminal.get("update", ())
            if isinstance(c.func, ast.Attribute) and dotted(c.func.value) == key
        ]
        if updates or _escapes(ctx, key):
            continue
        yield ctx.finding(
            AG204,
            steps[0],
            f"{key}.step() is never followed by {key}.update() "
            "anywhere in this file: the loss scale never changes",
            scaler=key,
        )


def _escapes(ctx: Context, key: str) -> bool:
    """``key`` is passed to a call, returned, stored in a container or aliased."""
    model = ctx.model
    for call in model.calls:
        for arg in (*call.args, *(kw.value for kw in call.keywords)):
            if dotted(arg.value if isinstance(arg, ast.Starred) else arg) == key:
                return True
    for node in walk(model.tree):
        if isinstance(node, (ast.Return, ast.Yield, ast.Assign, ast.Dict, ast.List, ast.Tuple)):
            values = _values(node)
            if any(dotted(v) == key for v in values):
                return True
    return False


def _values(
    node: ast.Return | ast.Yield | ast.Assign | ast.Dict | ast.List | ast.Tuple,
) -> list[ast.AST]:
    if isinstance(node, (ast.Return, ast.Yield, ast.Assign)):
        return [node.value] if node.value is not None else []
    if isinstance(node, ast.Dict):
        return list(node.values)
    return list(node.elts)


AG204 = Rule.from_code(
    "AG204",
    fix="call scaler.update() exactly once per optimizer step, right after scaler.step(optimizer) "
    "(inside the same accumulation branch)",
    triggers=("caler", "unscale_", ".scale("),
    check=_check,
)
