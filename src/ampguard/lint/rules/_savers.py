"""Where a file saves a checkpoint: ``torch.save(obj, ...)`` and calls to the project's own
savers (``save_checkpoint(state, path)``, ``utils.save_on_master(ckpt, path)``), same file or, in
project mode, another file of the tree; each with the object it saves."""

from __future__ import annotations

import ast
from typing import Any

from ampguard.lint._context import keyword
from ampguard.lint._model import FUNCS, FileModel
from ampguard.lint._names import dotted
from ampguard.lint._project import resolve_def
from ampguard.lint.rules._base import Context

__all__ = ["builder_calls", "save_sites"]

_SAVE = frozenset({"torch.save"})
_MAX_DEPTH = 2  # save_checkpoint -> save_on_master -> torch.save
# a parameter the helper saves: (position among the positional parameters or None, name)
_Param = tuple[int | None, str]


def save_sites(ctx: Context) -> list[tuple[ast.Call, ast.AST | None]]:
    """(call, the object it saves) for every save in the file (cached per file)."""
    if "save_sites" in ctx.cache:
        return ctx.cache["save_sites"]
    model = ctx.model
    sites: list[tuple[ast.Call, ast.AST | None]] = [
        (call, keyword(call, "obj", 0)) for call in model.calls_to(_SAVE)
    ]
    seen = {id(call) for call, _ in sites}
    memo: dict[int, _Param | None] = {}
    for call in model.calls:
        if id(call) in seen or not (call.args or call.keywords):
            continue
        found = resolve_def(model, call.func)
        if found is None or not isinstance(found[1], FUNCS):
            continue
        param = _saved_param(found[0], found[1], 0, memo)
        if param is not None:
            sites.append((call, _argument(call, param, found[1])))
    ctx.cache["save_sites"] = sites
    return sites


def builder_calls(ctx: Context) -> list[tuple[ast.Call, FileModel, Any, ast.Call, ast.AST]]:
    """Calls to a saver in another file (project mode) that saves a dict it builds itself
    (``def save_checkpoint(model, optimizer, lr, it, path): torch.save({...}, path)``): (call,
    the saver's file, its ``def``, the save inside it, the object that save writes). Cached."""
    if "builder_calls" in ctx.cache:
        return ctx.cache["builder_calls"]
    model = ctx.model
    out = []
    memo: dict[int, _Param | None] = {}
    built: dict[int, tuple[ast.Call, ast.AST] | None] = {}
    if model.project is not None:
        for call in model.calls:
            found = resolve_def(model, call.func)
            if found is None or found[0] is model or not isinstance(found[1], FUNCS):
                continue
            owner, func = found
            if id(func) not in built:
                built[id(func)] = _built_save(owner, func, memo)
            save = built[id(func)]
            if save is not None:
                out.append((call, owner, func, save[0], save[1]))
    ctx.cache["builder_calls"] = out
    return out


def _built_save(model: FileModel, func: Any, memo: dict[int, _Param | None]) -> Any:
    """The save in ``func`` of an object that is not one of its parameters, and that object."""
    params = set(_params(func)) | {a.arg for a in func.args.kwonlyargs}
    for node in model.statements(func.body):
        if not isinstance(node, ast.Call):
            continue
        if model.call_name(node) in _SAVE:
            obj = keyword(node, "obj", 0)
        elif (inner := resolve_def(model, node.func)) is not None and isinstance(inner[1], FUNCS):
            param = _saved_param(inner[0], inner[1], 1, memo)
            obj = _argument(node, param, inner[1]) if param is not None else None
        else:
            continue
        if obj is None or (isinstance(obj, ast.Name) and obj.id in params):
            continue
        if isinstance(obj, (ast.Dict, ast.Name, ast.Call)):
            return node, obj
    return None


def _params(func: Any) -> list[str]:
    return [a.arg for a in (*func.args.posonlyargs, *func.args.args)]


def _argument(call: ast.Call, param: _Param, func: Any) -> ast.AST | None:
    position, name = param
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if position is not None:
        if isinstance(call.func, ast.Attribute) and _params(func)[:1] in (["self"], ["cls"]):
            position -= 1
        if 0 <= position < len(call.args) and not isinstance(call.args[position], ast.Starred):
            return call.args[position]
    return None


def _saved_param(
    model: FileModel, func: Any, depth: int, memo: dict[int, _Param | None]
) -> _Param | None:
    """The parameter ``func`` hands to ``torch.save`` unchanged (no entries added), if any."""
    if id(func) in memo:
        return memo[id(func)]
    memo[id(func)] = None  # recursion guard
    params = _params(func)
    vararg = func.args.vararg.arg if func.args.vararg is not None else None
    found: _Param | None = None
    for node in model.statements(func.body):
        if not isinstance(node, ast.Call):
            continue
        if model.call_name(node) in _SAVE:  # torch.save(*args, **kwargs) keeps the Starred
            obj = node.args[0] if node.args else keyword(node, "obj")
        elif (
            depth < _MAX_DEPTH
            and (inner := resolve_def(model, node.func)) is not None
            and isinstance(inner[1], FUNCS)
        ):
            param = _saved_param(inner[0], inner[1], depth + 1, memo)
            obj = _argument(node, param, inner[1]) if param is not None else None
        else:
            continue
        if isinstance(obj, ast.Name) and obj.id in params:
            found = (params.index(obj.id), obj.id)
        elif (
            isinstance(obj, ast.Starred)
            and isinstance(obj.value, ast.Name)
            and obj.value.id == vararg
        ):
            found = (len(params), obj.value.id)  # save_on_master(*args): the first extra one
        if found is not None:
            break
    if found is not None and _adds_entries(model, func, found[1]):
        found = None
    memo[id(func)] = found
    return found


def _adds_entries(model: FileModel, func: Any, name: str) -> bool:
    """``state["scaler"] = ...`` or ``state.update(...)`` inside the helper."""
    for node in model.statements(func.body):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store)
            and dotted(node.value) == name
        ):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("update", "setdefault")
            and dotted(node.func.value) == name
        ):
            return True
    return False
