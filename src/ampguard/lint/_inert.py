"""Helpers that cannot change a flow rule's state: summarised once per ``def``, never inlined.

A training loop calls many project helpers that have nothing to do with the AMP protocol
(``validate.run(...)``, ``create_dataloader(...)``, ``colorstr(...)``). Inlining one means
interpreting its whole body again at every call site, on every path and every round of every
enclosing loop; in a detection repository that is most of the time project mode spends. A helper
is *inert* when interpreting it can only hand the caller's paths back as they came in:

- none of its statements produces a protocol event (``backward``, ``unscale_``, clip, ``step``,
  ``update``, ``zero_grad``, a scaler handed to an unknown call, ...), and every helper it calls
  is inert itself (what that one assigns of the arguments this helper passes on from its own
  parameters counts as assigned here);
- it declares no ``global``/``nonlocal``;
- no path through it ends early: no ``raise`` and no ``while True`` (a branch that raises prunes
  the caller's paths, which the interpreter must see).

Its branch tests on parameters may split the caller's paths, but every piece carries the same
state, so dropping the split changes nothing a rule reads. A helper that assigns one of its
parameters (``path = Path(path)``) is inert too: the interpreter then only makes the caller
forget what it assumed about the argument passed for it, as inlining would. The answer is
cached on the ``def`` node, which lives in the (project-cached) model of the file that holds it,
so every file that imports the helper reuses it. A call inside the helper that resolves through
the project is judged with the project's budget; an answer is cached unless the budget refused a
file while it was being reached (``Project.denied`` moved): an answer reached after the budget
ran out, but without needing a new file, is the answer a full budget gives, and is kept.

Cost: one walk over the helper's statements (and, transitively, its helpers') per ``def`` and run.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

from ampguard.lint._paths import stored_heads
from ampguard.lint._tree import children

__all__ = ["silent", "summary"]

_ATTR = "_ag_inert"
_SILENT = "_ag_silent"
_BUSY = "_ag_inert_busy"
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def summary(
    events: Any, helper: ast.FunctionDef | ast.AsyncFunctionDef, header: Callable
) -> frozenset[str] | None:
    """What inlining ``helper`` (a ``def`` of ``events.model``, an ``Events``; ``header`` gives a
    statement's own expressions) can do to the caller's paths: ``None`` when it may do anything
    (interpret it), else the parameters it assigns (the caller forgets what it assumed about
    the arguments passed for them; an empty set: nothing at all)."""
    cached = getattr(helper, _ATTR, None)
    if cached is not None:
        return None if cached is False else cached
    if getattr(helper, _BUSY, False):
        return None  # a call cycle: judged from outside the cycle, conservatively
    project = events.model.project
    denied = 0 if project is None else project.denied
    setattr(helper, _BUSY, True)
    try:
        result, quiet = _judge(events, helper, header)
    finally:
        setattr(helper, _BUSY, False)
    if project is None or project.denied == denied:
        setattr(helper, _ATTR, False if result is None else result)
        setattr(helper, _SILENT, quiet)
    return result


def silent(helper: ast.AST) -> bool:
    """A judged helper produces no protocol event (it may still end paths early: it is
    interpreted, but nothing in it can record a finding, whoever records)."""
    return getattr(helper, _SILENT, False) is True


def _judge(
    events: Any, helper: ast.FunctionDef | ast.AsyncFunctionDef, header: Callable
) -> tuple[frozenset[str] | None, bool]:
    """(what :func:`summary` returns, whether the helper is free of protocol events)."""
    args = helper.args
    params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    params.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
    touched: set[str] = set()
    exits = False  # a raise, global or endless loop: not inert, yet maybe free of events
    stack: list[ast.AST] = list(reversed(helper.body))
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES):
            continue  # a nested def's body does not run here
        if isinstance(node, (ast.Raise, ast.Global, ast.Nonlocal)):
            exits = True
        if (
            isinstance(node, ast.While)
            and isinstance(node.test, ast.Constant)
            and bool(node.test.value)
        ):
            exits = True
        if isinstance(node, ast.stmt):
            for event in events.of(node):  # calls to fully inert helpers are already left out
                stores = events.inert(event) if event.kind == "call" else None
                if stores is None:
                    if event.kind == "call" and silent(event.target):
                        exits = True
                        continue
                    return None, False
                # the inner helper assigns its parameters: the caller forgets about what it
                # passed for them, which for this helper's own parameters means its caller's
                touched.update(
                    head
                    for name, text in event.mapping
                    if name in stores and (head := text.split(".", 1)[0]) in params
                )
            touched.update(stored_heads(node, header) & params)
        stack.extend(children(node))
    return (None, True) if exits else (frozenset(touched), True)
