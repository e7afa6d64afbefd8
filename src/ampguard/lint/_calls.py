"""What a call passes and names: its arguments and the ``def`` its function resolves to.

Below :mod:`ampguard.lint._model` (the file model passes itself in), so that the model's GradScaler
facts (:mod:`ampguard.lint._scalers`) can use them without an import cycle.
"""

from __future__ import annotations

import ast
from typing import Any

from ampguard.lint._names import FUNCS

__all__ = ["argument_for", "constant", "keyword", "resolve_def"]


def keyword(call: ast.Call, name: str, position: int | None = None) -> ast.AST | None:
    """Argument ``name`` of ``call``, by keyword or at ``position``."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if position is not None and position < len(call.args):
        arg = call.args[position]
        return None if isinstance(arg, ast.Starred) else arg
    return None


def constant(node: ast.AST | None) -> object:
    """A literal's value; ``...`` (Ellipsis) when ``node`` is not a literal."""
    return node.value if isinstance(node, ast.Constant) else ...


def resolve_def(model: Any, func: ast.AST) -> tuple[Any, ast.AST] | None:
    """The ``def``/``class`` a call's function names, as (file model, node): in this file of
    ``model`` (a ``FileModel``), or (project mode) in another file of the linted tree. ``None``
    when it cannot be known (torch names are never followed)."""
    if isinstance(func, ast.Name):
        found = model.binding(func.id, model.scope_of(func))
        if found is not None and found[0] == "values":
            values: Any = found[1]
            if len(values) == 1 and isinstance(values[0], (*FUNCS, ast.ClassDef)):
                return model, values[0]
            return None
    elif not isinstance(func, ast.Attribute):
        return None
    project = model.project
    if project is None:
        return None
    qual = model.qualname(func)
    if qual is None or qual.split(".", 1)[0] == "torch":
        return None
    return project.resolve(qual, model.path)


def argument_for(func: Any, call: ast.Call, name: str) -> ast.AST | None:
    """The caller's argument for parameter ``name`` of ``func`` (a ``def`` or a class, whose
    ``__init__`` takes the arguments), by keyword or position, else the parameter's default;
    ``None`` when neither is known."""
    if isinstance(func, ast.ClassDef):
        init = next((s for s in func.body if isinstance(s, FUNCS) and s.name == "__init__"), None)
        if init is None:
            return None
        func = init
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    positional = [*func.args.posonlyargs, *func.args.args]
    params = [a.arg for a in positional]
    skip = 1 if params[:1] in (["self"], ["cls"]) else 0
    if name in params[skip:]:
        index = params.index(name) - skip
        if any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
            return None
        if index < len(call.args):
            return call.args[index]
        defaults = func.args.defaults  # not passed: the default, if it has one
        offset = len(positional) - len(defaults)
        at = params.index(name) - offset
        return defaults[at] if 0 <= at < len(defaults) else None
    for arg, default in zip(func.args.kwonlyargs, func.args.kw_defaults, strict=True):
        if arg.arg == name:
            return default
    return None
