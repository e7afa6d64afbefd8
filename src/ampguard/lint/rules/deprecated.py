"""AG206: deprecated AMP entry points (``torch.cuda.amp.*``, ``torch.cpu.amp.*``).

A use of the old spelling as a *fallback for old torch* is one documented case, reported the
same way wherever it sits (an import or a call): severity info, with the torch version from which
the new spelling works. A fallback is the old spelling in an ``except`` handler of a ``try`` (or a
``try`` whose handler holds the new spelling), or in a branch of an ``if``/conditional expression
whose test reads the torch version or probes for the API (``hasattr(torch.amp, "GradScaler")``),
or whose other branch uses the new spelling. Calls through a name a fallback import bound are not
reported again: the import is.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._model import FileModel
from ampguard.lint._names import DEPRECATED, canonical, dotted
from ampguard.lint._tree import walk
from ampguard.lint.rules._base import Context, Rule

__all__ = ["AG206"]

_DEPRECATED = frozenset(DEPRECATED)
_OLD_MODULES = ("torch.cuda.amp", "torch.cpu.amp")
# the torch release from which the new spelling works
_SINCE = {"autocast": "1.10", "GradScaler": "2.3", "custom_fwd": "2.4", "custom_bwd": "2.4"}
# a test that reads the torch version or probes for an API: version.parse(torch.__version__),
# hasattr(torch.amp, "GradScaler"), TORCH_2_3, IS_TORCH_GE_2_3, torch_ge_24
_PROBE = re.compile(r"version|^hasattr$|torch_?(ge|gt|lt|le)?_?\d", re.IGNORECASE)
_CATCHES = frozenset({"ImportError", "ModuleNotFoundError", "AttributeError", "TypeError"})
_TRIES: tuple[type[ast.Try], ...] = (ast.Try, getattr(ast, "TryStar", ast.Try))


def _check(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    compat_names: set[str] = set()
    for node in walk(model.tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias, qual in _old_imports(node):
                if _fallback(model, node):
                    compat_names.add(alias)
                    yield _compat(ctx, node, qual)
    called: set[str] = set()
    for call in model.calls_to(_DEPRECATED):
        if _root(call.func) in compat_names:
            continue
        if isinstance(call.func, (ast.Name, ast.Attribute)):
            called.add(dotted(call.func) or "")
        yield from _report(ctx, call, model.call_name(call))
    yield from _bound(ctx, called | compat_names)
    for funcs in model.functions.values():  # bare decorators: @torch.cuda.amp.custom_fwd
        for func in funcs:
            for deco in func.decorator_list:
                if isinstance(deco, (ast.Name, ast.Attribute)) and _root(deco) not in compat_names:
                    yield from _report(ctx, deco, model.qualname(deco))
    yield from _aliases(ctx)


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _old_imports(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str]]:
    """(bound name, what it names) for each old-API name an import binds."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.startswith(_OLD_MODULES) and alias.asname:
                yield alias.asname, alias.name
        return
    module = node.module or ""
    if node.level:
        return
    for alias in node.names:
        qual = canonical(f"{module}.{alias.name}")
        if qual in _DEPRECATED or qual in _OLD_MODULES:
            yield alias.asname or alias.name, qual


def _report(ctx: Context, node: ast.AST, qual: str | None) -> Iterator[Finding]:
    if qual not in DEPRECATED:
        return
    if _fallback(ctx.model, node):
        yield _compat(ctx, node, qual)
        return
    new, device, spelling = DEPRECATED[qual]
    used = ast.unparse(node.func if isinstance(node, ast.Call) else node)
    yield ctx.finding(
        AG206,
        node,
        f"{qual} is deprecated: use {spelling}",
        deprecated=qual,
        replacement=new,
        device=device,
        fixable=isinstance(node, ast.Call),
        fix=f"replace {used}(...) with {spelling}"
        if isinstance(node, ast.Call)
        else f"bind {new} instead of {used}, and pass {device!r} as the first argument where "
        "it is called",
    )


def _bound(ctx: Context, reported: set[str]) -> Iterator[Finding]:
    """``amp_autocast = torch.cuda.amp.autocast``: the old entry point bound to a name (later
    maybe reassigned in a branch, so its calls cannot be followed to it), reported where it is
    bound, unless a call through that name was reported already."""
    model = ctx.model
    for node in walk(model.tree):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Attribute):
            continue
        names = {n for t in node.targets if (n := dotted(t)) is not None}
        if not names or names & reported:
            continue
        yield from _report(ctx, node.value, model.qualname(node.value))


def _aliases(ctx: Context) -> Iterator[Finding]:
    """``GradScaler = torch.amp.GradScaler if hasattr(...) else torch.cuda.amp.GradScaler``."""
    model = ctx.model
    for node in walk(model.tree):
        if not isinstance(node, ast.IfExp):
            continue
        for branch in (node.body, node.orelse):
            if isinstance(branch, ast.Attribute):
                qual = model.qualname(branch)
                if qual in _DEPRECATED and _fallback(model, branch):
                    yield _compat(ctx, branch, qual)


def _compat(ctx: Context, node: ast.AST, qual: str) -> Finding:
    name = qual.rsplit(".", 1)[-1]
    if qual in DEPRECATED:
        new, device, spelling = DEPRECATED[qual]
    else:  # the module itself: from torch.cuda import amp
        new, device, spelling = "torch.amp", qual.split(".")[1], "torch.amp"
    since = _SINCE.get(name)
    works = f"works on torch >= {since}" if since else "is the current API"
    finding = ctx.finding(
        AG206,
        node,
        f"{qual} as a fallback for old torch: {spelling} {works}; when your minimum torch is "
        "that new, drop the fallback (the old spelling warns on every use since torch 2.4)",
        deprecated=qual,
        replacement=new,
        device=device,
        fallback=True,
    )
    return dataclasses.replace(
        finding,
        severity="info",
        fix=f"keep the fallback while you support older torch; then use {spelling} only",
    )


def _modern(model: FileModel, nodes: list[ast.stmt] | list[ast.AST]) -> bool:
    """``nodes`` use the current spelling (``torch.amp.X``, ``torch.autocast``, an import)."""
    for root in nodes:
        for node in walk(root):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.amp"):
                return True
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                if any(a.name in ("amp", "autocast") for a in node.names):
                    return True
            if isinstance(node, ast.Attribute):
                qual = model.qualname(node) or ""
                if qual.startswith("torch.amp.") or qual == "torch.amp":
                    return True
    return False


def _probe(test: ast.AST) -> bool:
    """A test that reads the torch version or probes for an API."""
    for node in walk(test):
        word = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if isinstance(word, str) and _PROBE.search(word):
            return True
    return False


def _catches_missing_api(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in _CATCHES for t in types)


def _fallback(model: FileModel, node: ast.AST) -> bool:
    """``node`` sits in compatibility code for old torch (see the module docstring)."""
    child = node
    for anc in model.ancestors(node):
        if isinstance(anc, _TRIES):
            handlers: list[ast.ExceptHandler] = list(anc.handlers)
            if child in handlers:
                assert isinstance(child, ast.ExceptHandler)
                if _catches_missing_api(child) or _modern(model, anc.body):
                    return True
            elif any(child is s for s in anc.body) and any(
                _modern(model, h.body) for h in handlers
            ):
                return True
        elif isinstance(anc, (ast.If, ast.IfExp)) and child is not anc.test:
            if isinstance(anc, ast.If):
                other: list[ast.AST] = list(anc.orelse if child in anc.body else anc.body)
            else:
                other = [anc.orelse if child is anc.body else anc.body]
            if _probe(anc.test) or _modern(model, other):
                return True
        child = anc
    return False


AG206 = Rule.from_code(
    "AG206",
    fix="replace torch.cuda.amp.X(...) with torch.amp.X('cuda', ...) and torch.cpu.amp.X(...) "
    "with torch.amp.X('cpu', ...) (for autocast: torch.amp.autocast(device_type=...))",
    triggers=("cuda.amp", "cpu.amp", "import amp"),
    check=_check,
)
