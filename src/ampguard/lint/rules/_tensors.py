"""Device tensors formatted as text (``f"{loss}"``, ``str(loss)``, ``print(loss)``): a host sync.

A name counts as a tensor where it is the loss: ``loss.backward()``, ``scaler.scale(loss)``,
``accelerator.backward(loss)`` or ``loss.item()`` in the same function, and the assignment that
reaches the formatting site is not a Python number (``loss = loss.item()``, ``float(...)``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from ampguard.lint._model import FileModel
from ampguard.lint._names import dotted, terminal
from ampguard.lint._reach import reaching_assignment

__all__ = ["formatted_tensors"]

_TO_NUMBER = frozenset({"item", "float", "int", "round", "tolist", "isfinite", "numpy"})
_FORMATTERS = frozenset({"str", "repr", "format"})


def _tensor_names(model: FileModel) -> dict[int, tuple[ast.AST, set[str]]]:
    """Per function (by id): names that hold a loss tensor somewhere in it."""
    out: dict[int, tuple[ast.AST, set[str]]] = {}

    def add(node: ast.AST | None, anchor: ast.AST) -> None:
        if isinstance(node, ast.Name):
            unit = model.function_of(anchor) or model.tree
            out.setdefault(id(unit), (unit, set()))[1].add(node.id)

    for call in model.by_terminal.get("backward", ()):
        if isinstance(call.func, ast.Attribute):
            add(call.func.value, call)
            if call.args and model.call_name(call) is None:  # accelerator.backward(loss)
                add(call.args[0], call)
    for call in model.by_terminal.get("item", ()):
        if isinstance(call.func, ast.Attribute) and not call.args:
            add(call.func.value, call)
    for call in model.by_terminal.get("scale", ()):
        func = call.func
        if (
            isinstance(func, ast.Attribute)
            and dotted(func.value) in model.scaler_keys
            and call.args
        ):
            add(call.args[0], call)
    return out


def _sites(model: FileModel, unit: Any, names: set[str]) -> Iterator[tuple[ast.AST, ast.Name]]:
    """(node that formats, the tensor name it formats) in ``unit``'s own body."""
    body = unit.body if isinstance(getattr(unit, "body", None), list) else []
    for node in model.statements(body):
        if isinstance(node, ast.FormattedValue):
            if isinstance(node.value, ast.Name) and node.value.id in names:
                yield node, node.value
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Name) and func.id in _FORMATTERS:
                arg = node.args[0]
                if isinstance(arg, ast.Name) and arg.id in names:
                    yield node, arg
            elif isinstance(func, ast.Name) and func.id == "print":
                for arg in node.args:
                    if isinstance(arg, ast.Name) and arg.id in names:
                        yield arg, arg
            elif (
                isinstance(func, ast.Attribute)
                and func.attr == "format"
                and isinstance(func.value, ast.Constant)
                and isinstance(func.value.value, str)
            ):
                for arg in node.args:
                    if isinstance(arg, ast.Name) and arg.id in names:
                        yield node, arg
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mod)
            and isinstance(node.left, ast.Constant)
            and isinstance(node.left.value, str)
        ):
            right = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
            for arg in right:
                if isinstance(arg, ast.Name) and arg.id in names:
                    yield node, arg


def _is_number(value: ast.AST | None) -> bool:
    if isinstance(value, ast.Constant):
        return True
    return value is not None and any(
        isinstance(n, ast.Call) and terminal(n.func) in _TO_NUMBER for n in ast.walk(value)
    )


def _still_tensor(model: FileModel, name: ast.Name) -> bool:
    reach = reaching_assignment(model, name.id, name)
    if reach is not None:
        return reach.value is not None and not _is_number(reach.value)
    values, _ = model.values_of(name)
    return bool(values) and not any(_is_number(v) for v in values)


def formatted_tensors(model: FileModel) -> Iterator[tuple[ast.AST, str]]:
    """Nodes that turn a device tensor into text, with a short description."""
    for unit, names in _tensor_names(model).values():
        for node, name in _sites(model, unit, names):
            if _still_tensor(model, name):
                if isinstance(node, ast.FormattedValue):
                    what = f'f"{{{name.id}}}"'
                else:
                    what = ast.unparse(node) if node is not name else f"print({name.id})"
                yield node, what
