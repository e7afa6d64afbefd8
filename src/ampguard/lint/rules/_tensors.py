"""Device tensors in a training step, and the expressions that copy one to the host (a sync).

A name (or ``outputs.loss``) holds a device tensor where it is the loss: ``loss.backward()``,
``scaler.scale(loss)``, ``accelerator.backward(loss)``, ``loss.item()`` in the same function; or
where it is assigned one: ``loss_items = loss.detach()``, ``mloss = torch.zeros(3, device=dev)``,
``mloss = (mloss * i + loss_items) / (i + 1)``. Tensor methods that keep a tensor on its device
(``detach``, ``mean``, ``float``, indexing, arithmetic) keep it a device tensor; ``.cpu()``,
``.numpy()``, ``.tolist()``, ``.item()`` bring it to the host, and a name assigned from those (or
from ``torch.tensor(...)`` without a device) is provably on the CPU: reading it costs no sync.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from ampguard.lint._calls import keyword
from ampguard.lint._model import FileModel
from ampguard.lint._names import dotted, terminal
from ampguard.lint._reach import reaching_assignment
from ampguard.lint._tree import walk

__all__ = ["TensorFacts", "host_syncs"]

# methods that return a tensor on the device of their receiver
_KEEPS = frozenset(
    {
        "detach",
        "mean",
        "sum",
        "float",
        "half",
        "bfloat16",
        "double",
        "clone",
        "cuda",
        "squeeze",
        "unsqueeze",
        "view",
        "reshape",
        "flatten",
        "abs",
        "max",
        "min",
        "norm",
        "sqrt",
        "exp",
        "log",
        "contiguous",
        "mul",
        "div",
        "add",
        "sub",
        "pow",
        "clamp",
        "std",
        "var",
        "argmax",
        "sigmoid",
        "softmax",
        "eq",
        "ne",
        "gt",
        "lt",
        "ge",
        "le",
        "long",
        "int",
        "bool",
        "type_as",
    }
)
_TO_HOST = frozenset({"cpu", "numpy", "tolist", "item"})
_TO_NUMBER = frozenset({"item", "float", "int", "round", "tolist", "isfinite", "numpy", "len"})
_CTORS = frozenset(
    {
        "torch.zeros",
        "torch.ones",
        "torch.full",
        "torch.empty",
        "torch.tensor",
        "torch.as_tensor",
        "torch.arange",
        "torch.randn",
        "torch.rand",
    }
)
_LIKE = frozenset({"torch.zeros_like", "torch.ones_like", "torch.full_like", "torch.empty_like"})
_MATH = frozenset(
    {
        "torch.stack",
        "torch.cat",
        "torch.mean",
        "torch.sum",
        "torch.norm",
        "torch.sqrt",
        "torch.exp",
        "torch.log",
        "torch.abs",
        "torch.max",
        "torch.min",
        "torch.clamp",
        "torch.where",
    }
)
_FORMATTERS = frozenset({"str", "repr", "format"})
_NUMBERS = frozenset({"float", "int"})


class TensorFacts:
    """Which expressions of one file hold a device tensor (per function, cached)."""

    def __init__(self, model: FileModel) -> None:
        self.model = model
        self._names: dict[int, set[str]] = {}
        self._seed()
        self._propagate()

    # ------------------------------------------------------------------ names
    def _add(self, node: ast.AST | None, anchor: ast.AST) -> None:
        key = dotted(node)
        if key is not None and key != "self":
            unit = self.model.function_of(anchor) or self.model.tree
            self._names.setdefault(id(unit), set()).add(key)

    def _seed(self) -> None:
        model = self.model
        for call in model.by_terminal.get("backward", ()):
            if isinstance(call.func, ast.Attribute):
                self._add(call.func.value, call)
                if call.args and model.call_name(call) is None:  # accelerator.backward(loss)
                    self._add(call.args[0], call)
        for call in model.by_terminal.get("item", ()):
            if isinstance(call.func, ast.Attribute) and not call.args:
                if not self.on_host(call.func.value):
                    self._add(call.func.value, call)
        for call in model.by_terminal.get("scale", ()):
            func = call.func
            if (
                isinstance(func, ast.Attribute)
                and dotted(func.value) in model.scaler_keys
                and call.args
            ):
                self._add(call.args[0], call)

    def _propagate(self) -> None:
        """Names assigned a device tensor (``loss_items = loss.detach()``), two rounds."""
        assigns = [
            node
            for node in walk(self.model.tree)
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ]
        for _ in range(2):
            for node in assigns:
                if self.on_device(node.value):
                    self._add(node.targets[0], node)

    def names(self, anchor: ast.AST) -> set[str]:
        unit = self.model.function_of(anchor) or self.model.tree
        return self._names.get(id(unit), set())

    # ------------------------------------------------------------------ expressions
    def on_device(self, expr: ast.AST, depth: int = 0) -> bool:
        """``expr`` is (very likely) a tensor on an accelerator: reading it on the host syncs."""
        if depth > 12:
            return False
        if isinstance(expr, (ast.Name, ast.Attribute)):
            key = dotted(expr)
            names = self.names(expr)
            if key is not None and key in names:
                return not isinstance(expr, ast.Name) or self._still_tensor(expr)
            if isinstance(expr, ast.Attribute):
                if expr.attr in ("grad", "data"):
                    return self.on_device(expr.value, depth + 1)
                base = dotted(expr.value)  # outputs.logits where outputs.loss is one
                if base is not None and base != "self":
                    return any(n.startswith(base + ".") for n in names)
            return False
        if isinstance(expr, (ast.Subscript, ast.Starred)):
            return self.on_device(expr.value, depth + 1)
        if isinstance(expr, ast.BinOp):
            if _is_text(expr.left):  # "%.3f" % loss is a str
                return False
            return self.on_device(expr.left, depth + 1) or self.on_device(expr.right, depth + 1)
        if isinstance(expr, ast.UnaryOp):
            return self.on_device(expr.operand, depth + 1)
        if not isinstance(expr, ast.Call):
            return False
        func = expr.func
        qual = self.model.call_name(expr)
        if qual in _CTORS:
            device = keyword(expr, "device")
            return device is not None and not _is_cpu(device)
        if qual in _LIKE:
            return bool(expr.args) and self.on_device(expr.args[0], depth + 1)
        if qual in _MATH:
            args = [*expr.args]
            if args and isinstance(args[0], (ast.List, ast.Tuple)):
                args = [*args[0].elts, *args[1:]]
            return any(self.on_device(a, depth + 1) for a in args)
        if isinstance(func, ast.Attribute) and qual is None:
            if func.attr == "to":
                target = expr.args[0] if expr.args else keyword(expr, "device")
                if target is not None and _is_cpu(target):
                    return False
                return self.on_device(func.value, depth + 1)
            if func.attr == "detach":
                return not self.on_host(func.value)
            if func.attr in _KEEPS:
                return self.on_device(func.value, depth + 1)
        return False

    def on_host(self, expr: ast.AST, depth: int = 0) -> bool:
        """``expr`` is provably on the CPU (``x.cpu()``, ``torch.tensor(...)`` with no device,
        a name assigned one of those): reading it costs no device sync."""
        if depth > 8:
            return False
        if isinstance(expr, ast.Call):
            func = expr.func
            qual = self.model.call_name(expr)
            if qual in _CTORS:
                device = keyword(expr, "device")
                return device is None or _is_cpu(device)
            if isinstance(func, ast.Attribute) and qual is None:
                if func.attr in ("cpu", "numpy", "tolist"):
                    return True
                if func.attr == "to":
                    target = expr.args[0] if expr.args else keyword(expr, "device")
                    return target is not None and _is_cpu(target)
                if func.attr in _KEEPS:
                    return self.on_host(func.value, depth + 1)
            return False
        if isinstance(expr, (ast.Subscript, ast.Starred)):
            return self.on_host(expr.value, depth + 1)
        if isinstance(expr, ast.Name):
            reach = reaching_assignment(self.model, expr.id, expr)
            if reach is not None and reach.value is not None:
                return self.on_host(reach.value, depth + 1)
            values, complete = self.model.values_of(expr)
            return complete and bool(values) and all(self.on_host(v, depth + 1) for v in values)
        return False

    def _still_tensor(self, name: ast.Name) -> bool:
        """The assignment that reaches ``name`` is not a Python number (``loss = loss.item()``)."""
        reach = reaching_assignment(self.model, name.id, name)
        if reach is not None:
            if reach.value is None:  # a loop target / with target: what the function said
                return True
            return not _is_number(reach.value) and not self.on_host(reach.value)
        values, _ = self.model.values_of(name)
        return not values or not any(_is_number(v) or self.on_host(v) for v in values)


def _is_cpu(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cpu"
    if isinstance(node, ast.Call) and terminal(node.func) == "device" and node.args:
        return _is_cpu(node.args[0])
    return False


def _is_text(node: ast.AST) -> bool:
    """A str expression: a literal, an f-string, or literals joined (``"%10s" + "%10.4g" * 3``)."""
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, ast.BinOp) and (_is_text(node.left) or _is_text(node.right))


def _is_number(value: ast.AST | None) -> bool:
    if isinstance(value, ast.Constant):
        return True
    return value is not None and any(
        isinstance(n, ast.Call) and terminal(n.func) in _TO_NUMBER for n in walk(value)
    )


def _units(model: FileModel) -> list[Any]:
    return [model.tree, *(f for funcs in model.functions.values() for f in funcs)]


def _has_host_copy(expr: ast.AST) -> bool:
    """``expr`` already holds a host copy inside it (``x.cpu().numpy()``: report the ``cpu``)."""
    for node in walk(expr):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _TO_HOST
            and not node.args
        ):
            return True
    return False


def host_syncs(model: FileModel, facts: TensorFacts) -> Iterator[tuple[ast.AST, str]]:
    """Nodes that copy a device tensor to the host, with the text that does it."""
    for unit in _units(model):
        body = unit.body if isinstance(getattr(unit, "body", None), list) else []
        for node in model.statements(body):
            yield from _site(node, facts)


def _named(tensor: ast.AST) -> str:
    """A tensor expression as a message names it: its text, or its last name when long
    (``mloss`` of ``(mloss * 2)``, ``loss`` of ``out["loss"].mean()``)."""
    if isinstance(tensor, ast.Starred):
        tensor = tensor.value
    text = ast.unparse(tensor)
    if len(text) <= 30:
        return text
    for node in walk(tensor):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, (ast.Name, ast.Attribute)):
            return ast.unparse(node) if len(ast.unparse(node)) <= 30 else getattr(node, "attr", "")
    return text[:27] + "..."


def _site(node: ast.AST, facts: TensorFacts) -> Iterator[tuple[ast.AST, str]]:
    device = facts.on_device
    if isinstance(node, ast.FormattedValue):
        if device(node.value):
            yield node, f'f"{{{ast.unparse(node.value)}}}"'
        return
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Mod) and _is_text(node.left):
            right = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
            tensors = [a for a in right if device(a)]
            if tensors:  # named by the tensor it formats, not by the whole expression
                yield node, f"'%' formatting of {_named(tensors[0])}"
        return
    if not isinstance(node, ast.Call):
        return
    func = node.func
    if isinstance(func, ast.Attribute):
        if func.attr in _TO_HOST and not node.args and not node.keywords:
            recv = func.value
            if _has_host_copy(recv) or facts.on_host(recv):
                return
            if func.attr in ("item", "cpu") or device(recv):  # only tensors (and modules) have them
                yield node, ast.unparse(node)
        elif (
            func.attr == "format"
            and isinstance(func.value, ast.Constant)
            and isinstance(func.value.value, str)
            and any(device(a) for a in node.args)
        ):
            tensor = next(a for a in node.args if device(a))
            yield node, f"str.format of {_named(tensor)}"
        return
    if not isinstance(func, ast.Name) or not node.args:
        return
    if func.id in _NUMBERS or func.id in _FORMATTERS:
        if device(node.args[0]):
            yield node, ast.unparse(node)
    elif func.id == "print":
        for arg in node.args:
            if device(arg):
                yield arg, f"print({ast.unparse(arg)})"
