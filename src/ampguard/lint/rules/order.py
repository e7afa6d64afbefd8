"""AG201 (clipping scaled gradients) and AG202 (double optimizer step): order within one step."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._flow import Env, Event, FlowMemo, Interpreter, OutOfBudget
from ampguard.lint._spell import stepped_optimizer
from ampguard.lint.rules._base import Context, Rule
from ampguard.lint.rules._units import budget_note, events, flow_units

__all__ = ["AG201", "AG202"]

_UNSCALED = "unscaled"


class _ClipAnalysis:
    """May-facts: ("pending", scaler) after scale(loss).backward(); "unscaled" once unscale_ ran.

    A clip fires only when some path carries scaled gradients and *no* path unscaled them, so a
    correlated ``if amp: ... unscale_`` never produces a false finding.
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.found: dict[int, Finding] = {}

    def join(self, a: frozenset, b: frozenset) -> frozenset:
        return a | b

    def apply(self, state: frozenset, event: Event, env: Env) -> frozenset:
        kind = event.kind
        if kind == "bwd_scaled":
            return (state - {_UNSCALED}) | {("pending", env.rename(event.key))}
        if kind in ("unscale", "opaque"):
            return state | {_UNSCALED}
        if kind in ("update", "zero"):
            return frozenset()
        if kind == "clip" and env.record and _UNSCALED not in state:
            pending = sorted(f[1] for f in state if isinstance(f, tuple) and f[0] == "pending")
            if pending and id(event.node) not in self.found:
                opt = stepped_optimizer(self.ctx.model, pending[0], event.node)
                self.found[id(event.node)] = self.ctx.finding(
                    AG201,
                    event.node,
                    f"gradient clipping runs on scaled gradients: no {pending[0]}.unscale_"
                    f"({opt or 'optimizer'}) after {pending[0]}.scale(...).backward() in this "
                    "step",
                    scaler=pending[0],
                    optimizer=opt,
                )
        return state


class _DoubleStepAnalysis:
    """Facts (may, must): ("scaler"/"plain", opt, node) after scaler.step(opt) / opt.step().

    A second step fires when the first one ran on every path (must), or on some path while the
    second is no more conditional than the first (its ``if`` conditions are a prefix of the
    first's), as in ``if amp: scaler.step(opt) ... opt.step()``. Steps in correlated or exclusive
    branches (``if amp: scaler.step(opt)`` / ``if not amp: opt.step()``) never fire. A loop's
    body is judged once more from what an iteration leaves, so a step that follows the previous
    iteration's with no backward in between fires even where the first iteration skips it.
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.found: dict[int, Finding] = {}

    def join(self, a: tuple, b: tuple) -> tuple:
        return a[0] | b[0], a[1] & b[1]

    def apply(self, state: tuple, event: Event, env: Env) -> tuple:
        kind = event.kind
        may, must = state
        if kind in ("bwd", "bwd_scaled", "zero"):
            return frozenset(), frozenset()
        if kind == "sstep" and event.arg is not None:
            opt: str | None = env.rename(event.arg)
            if self._earlier(state, "plain", opt, event.node):
                self._report(
                    event,
                    env,
                    opt,
                    f"{env.rename(event.key)}.step({opt}) after {opt}"
                    f".step() in the same step: the optimizer steps twice",
                )
            return may | {("scaler", opt, event.node)}, must | {("scaler", opt)}
        if kind == "ostep":
            opt = env.rename(event.key)
            if self._earlier(state, "scaler", opt, event.node):
                self._report(
                    event,
                    env,
                    opt,
                    f"{opt}.step() after scaler.step({opt}) in the same "
                    "step: the optimizer steps twice (scaler.step already stepped it)",
                )
            return may | {("plain", opt, event.node)}, must | {("plain", opt)}
        return state

    def _earlier(self, state: tuple, kind: str, opt: str | None, node: ast.AST) -> bool:
        may, must = state
        if (kind, opt) in must:
            return True
        model = self.ctx.model
        here = model.branch_path(node)
        for fact in may:
            if (
                fact[0] == kind
                and fact[1] == opt
                and model.function_of(fact[2]) is model.function_of(node)
                and model.branch_path(fact[2])[: len(here)] == here
            ):
                return True
        return False

    def _report(self, event: Event, env: Env, opt: str | None, message: str) -> None:
        if env.record and id(event.node) not in self.found:
            self.found[id(event.node)] = self.ctx.finding(AG202, event.node, message, optimizer=opt)


def _run(
    ctx: Context,
    analysis: _ClipAnalysis | _DoubleStepAnalysis,
    start: object,
    carried: bool = False,
) -> Iterator[Finding]:
    """Each unit from ``start``; with ``carried``, each of its loops' bodies again from the state
    one iteration leaves (what the next one starts with: the first iteration's state is not
    joined in, so a step that follows the previous iteration's is judged on those paths alone)."""
    extractor = events(ctx)
    model = ctx.model
    memo = FlowMemo()  # helpers' exits, shared by the units (see Interpreter.memo)
    for unit in flow_units(ctx):
        before = set(analysis.found)
        try:
            Interpreter(extractor, analysis, memo=memo).body(unit.body, start, record=True)
            for loop in model.loops if carried else ():
                if (model.function_of(loop) or model.tree) is unit:
                    _next_iteration(Interpreter(extractor, analysis, memo=memo), loop, start)
        except OutOfBudget as error:
            for key in set(analysis.found) - before:
                del analysis.found[key]
            memo.clear()  # entries made in this unit may stand for findings just dropped
            yield from budget_note(ctx, unit, error)
    yield from analysis.found.values()


def _next_iteration(
    interp: Interpreter, loop: ast.For | ast.AsyncFor | ast.While, start: object
) -> None:
    """Judge ``loop``'s body once more, entered with what one iteration leaves (its own budget:
    the body was already interpreted within the unit's, from more paths)."""
    back = interp.join(*interp.body(loop.body, start, record=False))
    if back is not None:
        interp.body(loop.body, back, record=True)


def _check_clip(ctx: Context) -> Iterator[Finding]:
    return _run(ctx, _ClipAnalysis(ctx), frozenset())


def _check_double(ctx: Context) -> Iterator[Finding]:
    return _run(ctx, _DoubleStepAnalysis(ctx), (frozenset(), frozenset()), carried=True)


AG201 = Rule.from_code(
    "AG201",
    fix="call scaler.unscale_(optimizer) after scaler.scale(loss).backward() and before "
    "clip_grad_norm_/clip_grad_value_, so the threshold applies to the real gradients",
    triggers=("clip",),  # clip_grad_norm_, or a clipping object (self.clipper(params))
    check=_check_clip,  # also needs a scaler: cheap to find out
)
AG202 = Rule.from_code(
    "AG202",
    fix="call only scaler.step(optimizer); it runs optimizer.step() itself unless the gradients "
    "overflowed",
    triggers=("caler", "unscale_", ".scale("),
    check=_check_double,
)
