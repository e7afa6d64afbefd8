"""What the rules read: one pass over a file's AST for parents, scopes, imports, bindings and calls.

Names are resolved the way a reader would: through imports (``from torch.cuda import amp``), aliases
(``GradScaler = torch.cuda.amp.GradScaler``, ``partial(torch.autocast, ...)``), simple assignments
(``scaler = GradScaler()``) and attributes (``self.scaler = ...``, keyed by their text).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from ampguard.lint._names import FUNCS, canonical, dotted, terminal
from ampguard.lint._scalers import ScalerFacts
from ampguard.lint._tree import children

__all__ = ["FUNCS", "FileModel", "Scope", "branch_of"]

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
# ``try``/``except*`` (3.11+) hold handlers and an ``else`` alike; typeshed for 3.10 has no TryStar.
_TRIES: tuple[type[ast.Try], ...] = (ast.Try, getattr(ast, "TryStar", ast.Try))
_SKIP_FIELDS = frozenset({"ctx", "op", "ops"})
_PARENT = "_ag_parent"
# node types ``FileModel._collect`` records something for
_COLLECTED = frozenset(
    {
        ast.Call,
        ast.Assign,
        ast.AnnAssign,
        ast.NamedExpr,
        ast.AugAssign,
        ast.Import,
        ast.ImportFrom,
        *_SCOPES,
        ast.ClassDef,
        ast.For,
        ast.AsyncFor,
        ast.While,
        ast.comprehension,
        ast.withitem,
        ast.ExceptHandler,
    }
)

# What ``FileModel.top_unit`` returns: a module-level def or class, or the module itself.
TopUnit = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module
# What a name is bound to: ``("import", qualname)`` or ``("values", [value or None, ...])``.
Binding = tuple[Literal["import"], str] | tuple[Literal["values"], list[ast.AST | None]]


class Scope:
    """Names bound in one function (or the module): imports, assigned values, star imports."""

    __slots__ = ("node", "parent", "imports", "assigns", "stars")

    def __init__(self, node: ast.AST, parent: Scope | None) -> None:
        self.node = node
        self.parent = parent
        self.imports: dict[str, str] = {}
        self.assigns: dict[str, list[ast.AST | None]] = {}  # None: a value we cannot know
        self.stars: list[str] = []

    def bind(self, name: str, value: ast.AST | None) -> None:
        self.assigns.setdefault(name, []).append(value)


class FileModel(ScalerFacts):
    """Facts about one parsed file, collected in a single iterative pass."""

    def __init__(self, tree: ast.Module, path: str = "<string>", project: Any = None) -> None:
        self.tree = tree
        self.path = path
        self.project = project  # a lint._project.Project in project mode
        self.calls: list[ast.Call] = []
        self.by_terminal: dict[str, list[ast.Call]] = {}
        self.scopes: dict[ast.AST, Scope] = {}
        self.attr_bindings: dict[str, list[ast.AST | None]] = {}
        self.subscript_sets: list[tuple[ast.Subscript, ast.AST]] = []
        # ``model, opt, scaler = build(cfg)``: a call's result unpacked into names
        self.unpacked_calls: list[tuple[ast.Tuple | ast.List, ast.Call]] = []
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.loops: list[ast.For | ast.AsyncFor | ast.While] = []
        self._qual: dict[int, str | None] = {}
        self._calls_to: dict[frozenset[str], list[ast.Call]] = {}
        self._collect()

    # ----------------------------------------------------------------- collection
    def _collect(self) -> None:
        module = Scope(self.tree, None)
        self.scopes[self.tree] = module
        stack: list[tuple[ast.AST, ast.AST | None, Scope]] = [(self.tree, None, module)]
        pop, push = stack.pop, stack.append
        for_types = (ast.For, ast.AsyncFor, ast.While)
        while stack:
            node, parent, scope = pop()
            setattr(node, _PARENT, parent)
            if type(node) not in _COLLECTED:  # most nodes: a set lookup, no isinstance chain
                pass
            elif isinstance(node, ast.Call):
                self.calls.append(node)
                name = terminal(node.func)
                if name is not None:
                    self.by_terminal.setdefault(name, []).append(node)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind(target, node.value, scope)
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
                if node.value is not None:
                    self._bind(node.target, node.value, scope)
            elif isinstance(node, ast.AugAssign):
                self._bind(node.target, None, scope)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self._import(node, scope)
            elif isinstance(node, _SCOPES):
                scope = self._enter(node, scope)
            elif isinstance(node, ast.ClassDef):
                scope.bind(node.name, node)
            elif isinstance(node, for_types):
                self.loops.append(node)
                if not isinstance(node, ast.While):
                    self._bind(node.target, None, scope)
            elif isinstance(node, ast.comprehension):
                self._bind(node.target, None, scope)
            elif isinstance(node, ast.withitem):
                if node.optional_vars is not None:
                    self._bind(node.optional_vars, None, scope)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                scope.bind(node.name, None)
            for field in node._fields:
                if field in _SKIP_FIELDS:
                    continue
                value = getattr(node, field, None)
                if isinstance(value, list):
                    for item in reversed(value):
                        if isinstance(item, ast.AST):
                            push((item, node, scope))
                elif isinstance(value, ast.AST):
                    push((value, node, scope))

    def _enter(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, scope: Scope
    ) -> Scope:
        if not isinstance(node, ast.Lambda):
            scope.bind(node.name, node)
            self.functions.setdefault(node.name, []).append(node)
        inner = Scope(node, scope)
        self.scopes[node] = inner
        args = node.args
        for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
            if arg is not None:
                inner.bind(arg.arg, None)
        return inner

    def _bind(self, target: ast.AST, value: ast.AST | None, scope: Scope) -> None:
        if isinstance(target, ast.Name):
            scope.bind(target.id, value)
        elif isinstance(target, ast.Attribute):
            key = dotted(target)
            if key is not None:
                self.attr_bindings.setdefault(key, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, ast.Call):
                self.unpacked_calls.append((target, value))
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) else None
            if values is not None and len(values) != len(target.elts):
                values = None
            for i, elt in enumerate(target.elts):
                self._bind(elt, values[i] if values is not None else None, scope)
        elif isinstance(target, ast.Starred):
            self._bind(target.value, None, scope)
        elif isinstance(target, ast.Subscript) and value is not None:
            self.subscript_sets.append((target, value))

    @staticmethod
    def _import(node: ast.Import | ast.ImportFrom, scope: Scope) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    scope.imports[alias.asname] = alias.name
                else:
                    head = alias.name.split(".", 1)[0]
                    scope.imports[head] = head
            return
        dots = "." * (node.level or 0)
        module = dots + (node.module or "")
        for alias in node.names:
            if alias.name == "*":
                scope.stars.append(module)
            else:  # ``from . import utils`` -> ``.utils`` (the dots count the levels)
                base = f"{module}." if node.module else dots
                scope.imports[alias.asname or alias.name] = f"{base}{alias.name}"

    # ----------------------------------------------------------------- structure
    @staticmethod
    def parent(node: ast.AST) -> ast.AST | None:
        """The node that holds ``node`` (``None`` for the module)."""
        return getattr(node, _PARENT, None)

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        """Parents of ``node`` from the nearest outwards."""
        anc: ast.AST | None = getattr(node, _PARENT, None)
        while anc is not None:
            yield anc
            anc = getattr(anc, _PARENT, None)

    def scope_of(self, node: ast.AST) -> Scope:
        """The function (or module) scope whose names ``node`` sees."""
        for anc in self.ancestors(node):
            if anc in self.scopes:
                return self.scopes[anc]
        return self.scopes[self.tree]

    def function_of(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The nearest enclosing ``def`` (``None`` at module level)."""
        for anc in self.ancestors(node):
            if isinstance(anc, FUNCS):
                return anc
        return None

    def class_of(self, node: ast.AST) -> ast.ClassDef | None:
        """The nearest enclosing class."""
        for anc in self.ancestors(node):
            if isinstance(anc, ast.ClassDef):
                return anc
        return None

    def top_unit(self, node: ast.AST) -> TopUnit:
        """The module-level ``def``/``class`` that holds ``node``, or the module itself."""
        last = node
        for anc in self.ancestors(node):
            if anc is self.tree:
                return last if isinstance(last, (*FUNCS, ast.ClassDef)) else self.tree
            last = anc
        return self.tree

    def branch_path(self, node: ast.AST) -> tuple[tuple[int, object], ...]:
        """Conditional branches ``node`` sits in, outermost first: ``(id(condition), branch)``."""
        path: list[tuple[int, object]] = []
        child = node
        for anc in self.ancestors(node):
            branch = branch_of(anc, child)
            if branch is not None:
                path.append((id(anc), branch))
            child = anc
        path.reverse()
        return tuple(path)

    def exclusive(self, a: ast.AST, b: ast.AST) -> bool:
        """True when ``a`` and ``b`` sit in different branches of the same ``if``/``match``/..."""
        seen = dict(self.branch_path(a))
        return any(key in seen and seen[key] != branch for key, branch in self.branch_path(b))

    def statements(self, body: Sequence[ast.AST]) -> Iterator[ast.AST]:
        """Every node under ``body`` in source order, not entering nested def/class/lambda."""
        stack: list[ast.AST] = list(reversed(body))
        while stack:
            node = stack.pop()
            yield node
            if isinstance(node, (*_SCOPES, ast.ClassDef)):
                continue
            stack.extend(reversed(children(node)))

    # ----------------------------------------------------------------- names
    def binding(self, name: str, scope: Scope) -> Binding | None:
        """``("import", qualname)`` or ``("values", [values])`` for ``name`` seen from ``scope``."""
        s: Scope | None = scope
        while s is not None:
            if name in s.imports:
                return "import", s.imports[name]
            values = s.assigns.get(name)
            if values is not None:
                return "values", values
            s = s.parent
        for star in self.scopes[self.tree].stars:
            if star.startswith("torch"):
                return "import", f"{star}.{name}"
        return None

    def qualname(self, expr: ast.AST, depth: int = 0) -> str | None:
        """Canonical dotted name ``expr`` refers to (``torch.amp.GradScaler``), else ``None``."""
        key = id(expr)
        if key in self._qual:
            return self._qual[key]
        result = self._qualname(expr, depth)
        self._qual[key] = result
        return result

    def _qualname(self, expr: ast.AST, depth: int) -> str | None:
        if depth > 8:
            return None
        attrs: list[str] = []
        while isinstance(expr, ast.Attribute):
            attrs.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        found = self.binding(expr.id, self.scope_of(expr))
        if found is None:
            return None
        if found[0] == "import":
            base = found[1]
        else:
            values = found[1]
            if len(values) != 1 or values[0] is None:
                return None
            value = values[0]
            if isinstance(value, ast.Call) and terminal(value.func) == "partial" and value.args:
                value = value.args[0]
            if not isinstance(value, (ast.Name, ast.Attribute)):
                return None
            resolved = self.qualname(value, depth + 1)
            if resolved is None:
                return None
            base = resolved
        for attr in reversed(attrs):
            base = f"{base}.{attr}"
        return canonical(base)

    def call_name(self, call: ast.Call) -> str | None:
        """Canonical name of the function a call invokes."""
        return self.qualname(call.func)

    def values_of(self, expr: ast.AST) -> tuple[list[ast.AST], bool]:
        """Values ``expr`` (a name or ``self.x``) was assigned, and whether that list is complete.

        Conditional expressions and ``a or b`` are opened up into their branches.
        """
        raw = self._assigned(expr)
        if not raw:
            return [], False
        out: list[ast.AST] = []
        complete = True
        stack = list(raw)
        while stack:
            value = stack.pop()
            if value is None:
                complete = False
            elif isinstance(value, ast.IfExp):
                stack.extend((value.body, value.orelse))
            elif isinstance(value, ast.BoolOp):
                stack.extend(value.values)
            else:
                out.append(value)
        return out, complete

    def _assigned(self, expr: ast.AST) -> list[ast.AST | None] | None:
        """The raw list of values bound to a name or ``self.x`` attribute (None if unknown)."""
        if isinstance(expr, ast.Name):
            found = self.binding(expr.id, self.scope_of(expr))
            return found[1] if found is not None and found[0] == "values" else None
        key = dotted(expr)
        return self.attr_bindings.get(key) if key is not None else None

    def single_value(self, expr: ast.AST) -> ast.AST | None:
        """The one value a name was ever assigned (no branches), else ``None``."""
        raw = self._assigned(expr)
        if raw and len(raw) == 1 and raw[0] is not None:
            return raw[0]
        return None

    def calls_to(self, targets: frozenset[str]) -> list[ast.Call]:
        """Calls whose function resolves to one of ``targets``, also through local aliases
        (``from torch import load as torch_load``, ``OldScaler = torch.cuda.amp.GradScaler``)."""
        cached = self._calls_to.get(targets)
        if cached is not None:
            return cached
        names = {t.rsplit(".", 1)[-1] for t in targets}
        for scope in self.scopes.values():
            names.update(n for n, t in scope.imports.items() if canonical(t) in targets)
            for name, values in scope.assigns.items():
                if (
                    len(values) == 1
                    and isinstance(values[0], (ast.Name, ast.Attribute))
                    and self.qualname(values[0]) in targets
                ):
                    names.add(name)
        found = [
            c
            for n in sorted(names)
            for c in self.by_terminal.get(n, ())
            if self.call_name(c) in targets
        ]
        self._calls_to[targets] = found
        return found


def branch_of(anc: ast.AST, child: ast.AST) -> object | None:
    """Which conditional branch of ``anc`` holds its child ``child`` (``None``: not conditional)."""
    if isinstance(anc, (ast.If, ast.IfExp)):
        if child is anc.test:
            return None
        return 0 if (child in anc.body if isinstance(anc, ast.If) else child is anc.body) else 1
    if isinstance(anc, ast.BoolOp):
        index = next(i for i, v in enumerate(anc.values) if v is child)
        return index if index > 0 else None
    if isinstance(anc, _TRIES):
        if child in anc.handlers:
            return "handler"
        if child in anc.orelse:
            return "else"
        return None
    if isinstance(anc, (ast.For, ast.AsyncFor, ast.While)):
        return "else" if child in anc.orelse else None
    if isinstance(anc, ast.comprehension):
        return "if" if child in anc.ifs else None
    if isinstance(anc, ast.Match):
        return next((i for i, c in enumerate(anc.cases) if c is child), None)
    return None
