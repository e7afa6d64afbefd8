"""Which assignment of a name reaches a given use: the last one before it on every path.

Flow-insensitive bindings (``FileModel.values_of``) give every value a name was ever assigned; a
checkpoint dict named ``ckpt`` that is first ``torch.load``-ed, then set to ``None`` and finally
rebuilt before ``torch.save(ckpt, ...)`` needs the one value that is actually saved.
"""

from __future__ import annotations

import ast

from ampguard.lint._model import FileModel

__all__ = ["Reaching", "reaching_assignment"]

_INDEX = "_ag_assign_index"
_UNIT_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
# (line, col, statement, value or None when the value cannot be known)
_Entry = tuple[int, int, ast.stmt, ast.AST | None]


class Reaching:
    """The assignment statement that reaches a use, and the value it assigned."""

    __slots__ = ("stmt", "value")

    def __init__(self, stmt: ast.stmt, value: ast.AST | None) -> None:
        self.stmt = stmt
        self.value = value


def _index(model: FileModel, unit: ast.AST) -> dict[str, list[_Entry]]:
    """Assignments to plain names in ``unit`` (not in nested scopes), in source order (cached)."""
    cached = getattr(unit, _INDEX, None)
    if cached is not None:
        return cached
    out: dict[str, list[_Entry]] = {}
    body = unit.body if hasattr(unit, "body") and isinstance(unit.body, list) else []
    for node in model.statements(body):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                _add(out, target, node.value, node)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            _add(out, node.target, node.value, node)
        elif isinstance(node, ast.AugAssign):
            _add(out, node.target, None, node)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            _add(out, node.target, None, node)
        elif (
            isinstance(node, ast.withitem)
            and node.optional_vars is not None
            and isinstance(with_ := model.parent(node), (ast.With, ast.AsyncWith))
        ):
            _add(out, node.optional_vars, None, with_)
    for entries in out.values():
        entries.sort(key=lambda e: (e[0], e[1]))
    setattr(unit, _INDEX, out)
    return out


def _add(
    out: dict[str, list[_Entry]], target: ast.AST, value: ast.AST | None, stmt: ast.stmt
) -> None:
    if isinstance(target, ast.Name):
        out.setdefault(target.id, []).append(
            (getattr(stmt, "lineno", 0), getattr(stmt, "col_offset", 0), stmt, value)
        )
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            _add(out, elt, None, stmt)
    elif isinstance(target, ast.Starred):
        _add(out, target.value, None, stmt)


def reaching_assignment(model: FileModel, name: str, site: ast.AST) -> Reaching | None:
    """The last assignment to ``name`` before ``site`` in its function, if it reaches ``site`` on
    every path (it sits in a block that encloses ``site``); ``None`` when that is not known."""
    unit = model.function_of(site) or model.tree
    entries = _index(model, unit).get(name)
    if not entries:
        return None
    line, col = getattr(site, "lineno", 0), getattr(site, "col_offset", 0)
    before = [e for e in entries if (e[0], e[1]) < (line, col)]
    if not before:
        return None
    _, _, stmt, value = before[-1]
    if any(a is stmt for a in model.ancestors(site)):  # ``for x in ...:`` / ``with ... as x:``
        return Reaching(stmt, None)
    if not _dominates(model, stmt, site):
        return None
    return Reaching(stmt, value)


def _dominates(model: FileModel, stmt: ast.AST, site: ast.AST) -> bool:
    """``stmt`` sits in a statement list that also holds ``site`` (or one of its ancestors)."""
    parent = model.parent(stmt)
    if parent is None:
        return False
    chain = {id(site)}
    chain.update(id(a) for a in model.ancestors(site))
    for field in ("body", "orelse", "finalbody", "handlers"):
        block = getattr(parent, field, None)
        if isinstance(block, list) and any(s is stmt for s in block):
            return any(id(s) in chain for s in block if s is not stmt)
    return False
