"""Path facts for the flow interpreter: branch conditions that stay fixed while a loop runs.

``if use_fp16:`` inside an accumulation loop takes the same branch on every iteration as long as
nothing assigns ``use_fp16``; ``if scaler is not None:`` in a helper and in its caller test the same
fact. The interpreter keeps one analysis state per set of such *assumptions* (``(condition text,
its value)``), so a path that took the fp16 branch never flows into the fp32 branch of the same
test, and forgets an assumption as soon as one of the names it reads is assigned.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

from ampguard.lint._names import dotted
from ampguard.lint._tree import children

__all__ = ["MAX_PATHS", "Assumption", "condition", "stored_heads"]

MAX_PATHS = 16  # more assumption sets than this are merged back into one state
Assumption = tuple[str, bool]
_NOT_FIXED = (
    ast.Call,
    ast.Await,
    ast.Yield,
    ast.YieldFrom,
    ast.NamedExpr,
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)
_STORES = "_ag_stored_heads"
_CONDITION = "_ag_condition"


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def condition(test: ast.AST, rename: dict[str, str]) -> tuple[str, bool] | None:
    """``(key, value the key has in the if-branch)`` for a test that reads only names and
    constants; ``None`` for a test that may change by itself (a call, a walrus, ...).

    ``X``, ``not X``, ``X is None`` and ``X is not None`` share the key ``"X is None"``, so a
    helper's ``if scaler is not None:`` and its caller's ``if scaler:`` agree. Inside a helper
    (``rename`` maps its parameters to the caller's arguments) only tests on parameters are kept.
    """
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = condition(test.operand, rename)
        return None if inner is None else (inner[0], not inner[1])
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Is, ast.IsNot))
        and _is_none(test.comparators[0])
    ):
        text = _renamed(dotted(test.left), rename)
        return None if text is None else (f"{text} is None", isinstance(test.ops[0], ast.Is))
    if isinstance(test, (ast.Name, ast.Attribute)):
        text = _renamed(dotted(test), rename)
        return None if text is None else (f"{text} is None", False)
    if rename:
        return None
    cached: tuple[str, bool] | bool | None = getattr(test, _CONDITION, None)
    if cached is None:  # the same test is read on every pass over a loop: read it once
        fixed = not any(isinstance(n, _NOT_FIXED) for n in ast.walk(test))
        cached = (ast.unparse(test), True) if fixed else False
        setattr(test, _CONDITION, cached)
    return cached if isinstance(cached, tuple) else None


def _renamed(text: str | None, rename: dict[str, str]) -> str | None:
    if text is None:
        return None
    if not rename:
        return text
    head, dot, rest = text.partition(".")
    new = rename.get(head)
    return None if new is None else new + dot + rest


def heads(key: str) -> set[str]:
    """Names an assumption's key reads."""
    try:
        tree = ast.parse(key.removesuffix(" is None"), mode="eval")
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def stored_heads(stmt: ast.AST, header: Callable[[ast.AST], list[ast.AST]]) -> frozenset[str]:
    """Names a statement (its ``header(stmt)``: the statement or a compound statement's
    header) assigns; kept on the statement (the interpreter asks on every pass over it)."""
    cached = stmt.__dict__.get(_STORES)
    if cached is not None:
        return cached
    out: set[str] = set()
    stack: list[Any] = list(header(stmt))
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        stack.append(stmt.target)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        ctx = getattr(node, "ctx", None)
        if isinstance(ctx, (ast.Store, ast.Del)):
            base = node
            while isinstance(base, (ast.Attribute, ast.Subscript, ast.Starred)):
                base = base.value
            if isinstance(base, ast.Name):
                out.add(base.id)
        stack.extend(children(node))
    result = frozenset(out)
    setattr(stmt, _STORES, result)
    return result
