"""The AMP protocol's events in the source, in evaluation order: ``scale(loss).backward()``,
``unscale_``, clip, ``step``, ``update``, ``zero_grad``, and calls to helpers (which the
interpreter follows: same file, ``self`` methods, or other files of the tree in project mode)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from ampguard.lint._context import is_scheduler_like, scaler_state
from ampguard.lint._inert import summary
from ampguard.lint._model import FUNCS, FileModel
from ampguard.lint._names import CLIPS, dotted, terminal
from ampguard.lint._project import resolve_def
from ampguard.lint._tree import children

__all__ = ["Event", "Events", "header"]


@dataclass(frozen=True)
class Event:
    """One step of the AMP protocol found in the source."""

    kind: str  # bwd, bwd_scaled, unscale, sstep, pstep, ostep, update, zero, clip, opaque, call
    node: ast.AST
    key: str | None = None  # scaler (or optimizer, for ostep) text
    arg: str | None = None  # optimizer text of scaler.step(opt)
    target: ast.AST | None = None  # helper ``def`` for kind == "call"
    mapping: tuple[tuple[str, str], ...] = ()  # helper parameter -> caller argument text
    owner: Any = None  # the FileModel that holds ``target`` (project mode: another file)


class Events:
    """Extracts (and caches) the events of statements in one file."""

    def __init__(self, model: FileModel) -> None:
        self.model = model
        self.scalers = model.scaler_keys
        self._cache: dict[int, list[Event]] = {}
        self._subs: dict[int, Events] = {}

    def sub(self, model: FileModel) -> Events:
        """The event extractor of another file (a helper defined there), cached."""
        found = self._subs.get(id(model))
        if found is None:
            found = self._subs[id(model)] = Events(model)
        return found

    def of(self, stmt: ast.AST) -> list[Event]:
        """Events a simple statement (or a compound statement's header) produces, in order."""
        key = id(stmt)
        found = self._cache.get(key)
        if found is None:
            project = self.model.project
            denied = 0 if project is None else project.denied
            found = [ev for call in _calls_in(header(stmt)) for ev in self._call(call)]
            if any(ev.kind == "call" for ev in found):  # inert helpers are not inlined
                found = [ev for ev in found if ev.kind != "call" or not self._inert(ev)]
            if project is None or project.denied == denied:
                self._cache[key] = found  # else asked again, so that a cached inert summary
            # never rests on a file the budget refused (see ampguard.lint._inert)
        return found

    def _inert(self, event: Event) -> bool:
        return self.inert(event) == frozenset()

    def inert(self, event: Event) -> frozenset[str] | None:
        """For a helper call: ``None`` if inlining it may change the state, else the helper's
        parameters it assigns (see :mod:`ampguard.lint._inert`); cached on the ``def``."""
        owner = event.owner if event.owner is not None else self.model
        events = self if owner is self.model else self.sub(owner)
        if not isinstance(event.target, FUNCS):
            return None
        return summary(events, event.target, header)

    def _call(self, call: ast.Call) -> list[Event]:
        func = call.func
        if (
            isinstance(func, ast.Attribute)
            and self.model.project is not None
            and (self.model.qualname(func) or "torch").split(".", 1)[0] != "torch"
        ):
            helper, owner = self._helper(call)  # engine.backward(loss, scaler): a module's def
            if helper is not None:
                return [
                    Event("call", call, target=helper, mapping=_mapping(helper, call), owner=owner)
                ]
        if isinstance(func, ast.Attribute):
            attr, key = func.attr, dotted(func.value)
            if attr == "backward":
                source = self._scaled_source(func.value)
                return [Event("bwd_scaled", call, source) if source else Event("bwd", call)]
            if attr == "unscale_" and key:
                return [Event("unscale", call, key)]
            if attr == "step" and key:
                if key in self.scalers:
                    return [Event("sstep", call, key, dotted(call.args[0]))] if call.args else []
                if call.args and self._is_parameter(func.value):  # a helper's scaler argument?
                    return [Event("pstep", call, key, dotted(call.args[0]))]
                if not is_scheduler_like(self.model, func.value):
                    return [Event("ostep", call, key)]
                return []
            if attr == "update" and (
                key in self.scalers
                or (not call.args and not call.keywords and self._is_parameter(func.value))
            ):
                return [Event("update", call, key)]
            if attr == "zero_grad":
                return [Event("zero", call)]
        if self.model.call_name(call) in CLIPS or self._clip_object(func):
            return [Event("clip", call)]
        helper, owner = self._helper(call)
        if helper is not None:
            return [Event("call", call, target=helper, mapping=_mapping(helper, call), owner=owner)]
        return [Event("opaque", call, key) for key in self._opaque_keys(call)]

    def _clip_object(self, func: ast.AST) -> bool:
        """``self.clip_grad_norm(params)`` where the attribute holds a clipping object: an
        instance of a class (this file or, in project mode, another) whose ``__call__`` runs
        ``clip_grad_norm_``, or ``functools.partial(clip_grad_norm_, ...)``."""
        if not isinstance(func, (ast.Name, ast.Attribute)):
            return False
        values, _ = self.model.values_of(func)
        for value in values:
            if not isinstance(value, ast.Call):
                continue
            if terminal(value.func) == "partial" and value.args:
                if self.model.qualname(value.args[0]) in CLIPS:
                    return True
                continue
            found = resolve_def(self.model, value.func)
            if found is not None and isinstance(found[1], ast.ClassDef):
                if _clips_when_called(found[0], found[1]):
                    return True
        return False

    def _is_parameter(self, node: ast.AST) -> bool:
        """``node`` is a bare parameter of its function (a helper's ``scaler`` argument)."""
        if not isinstance(node, ast.Name):
            return False
        func = self.model.function_of(node)
        args = func.args if func is not None else None
        return args is not None and any(
            a.arg == node.id for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
        )

    def _scaled_source(self, recv: ast.AST) -> str | None:
        if isinstance(recv, ast.Name):  # scaled = scaler.scale(loss); scaled.backward()
            value = self.model.single_value(recv)
            recv = value if value is not None else recv
        if (
            isinstance(recv, ast.Call)
            and isinstance(recv.func, ast.Attribute)
            and recv.func.attr == "scale"
        ):
            key = dotted(recv.func.value)
            if key not in self.scalers:
                return None
            ctor = self.model.ctor_of(key)  # GradScaler(enabled=False).scale(x) is just x
            return None if ctor is not None and scaler_state(self.model, ctor) == "off" else key
        return None

    def _helper(
        self, call: ast.Call
    ) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef | None, FileModel | None]:
        """The ``def`` a call runs: same file, a method of ``self``, or (project mode) a
        function of another linted file."""
        func = call.func
        if isinstance(func, ast.Attribute) and dotted(func.value) == "self":
            cls = self.model.class_of(call)
            for stmt in cls.body if cls is not None else ():
                if isinstance(stmt, FUNCS) and stmt.name == func.attr:
                    return stmt, self.model
            return None, None
        found = resolve_def(self.model, func)
        if found is None or not isinstance(found[1], FUNCS):
            return None, None
        return found[1], found[0]

    def _opaque_keys(self, call: ast.Call) -> list[str]:
        args = [*call.args, *(kw.value for kw in call.keywords)]
        keys = [k for a in args if (k := dotted(a)) is not None and k in self.scalers]
        func = call.func
        if isinstance(func, ast.Attribute) and dotted(func.value) == "self":  # unresolved method
            keys.extend(k for k in self.scalers if k.startswith("self."))
        return keys


_CLIPPER = "_ag_clips_when_called"


def _clips_when_called(model: FileModel, cls: ast.ClassDef) -> bool:
    """The class's ``__call__`` clips gradients (directly or through one of its own methods)."""
    cached = getattr(cls, _CLIPPER, None)
    if cached is not None:
        return cached
    methods = {s.name: s for s in cls.body if isinstance(s, FUNCS)}
    result = False
    todo, seen = ["__call__"], set()
    while todo and not result:
        name = todo.pop()
        method = methods.get(name)
        if method is None or name in seen:
            continue
        seen.add(name)
        for node in model.statements(method.body):
            if not isinstance(node, ast.Call):
                continue
            if model.call_name(node) in CLIPS:
                result = True
                break
            func = node.func
            if isinstance(func, ast.Attribute) and dotted(func.value) == "self":
                todo.append(func.attr)
    setattr(cls, _CLIPPER, result)
    return result


def header(stmt: ast.AST) -> list[ast.AST]:
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [stmt.iter]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return [item.context_expr for item in stmt.items]
    if isinstance(stmt, ast.Match):
        return [stmt.subject]
    if isinstance(stmt, (*FUNCS, ast.ClassDef, ast.Try, getattr(ast, "TryStar", ast.Try))):
        return []
    return [stmt]


def _calls_in(roots: list[ast.AST]) -> list[ast.Call]:
    """Calls under ``roots`` in evaluation order (arguments before the call), skipping lambdas."""
    out: list[ast.Call] = []
    stack: list[tuple[ast.AST, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            out.append(node)  # type: ignore[arg-type]
            continue
        if isinstance(node, ast.Call):
            stack.append((node, True))
        if isinstance(node, ast.Lambda):
            continue
        stack.extend((c, False) for c in reversed(children(node)))
    return out


def _mapping(
    helper: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call
) -> tuple[tuple[str, str], ...]:
    params = [a.arg for a in (*helper.args.posonlyargs, *helper.args.args)]
    if params and params[0] in ("self", "cls") and isinstance(call.func, ast.Attribute):
        params = params[1:]
    pairs = []
    for name, arg in zip(params, call.args, strict=False):
        if isinstance(arg, ast.Starred):
            break
        if (text := dotted(arg)) is not None:
            pairs.append((name, text))
    for kw in call.keywords:
        if kw.arg is not None and (text := dotted(kw.value)) is not None:
            pairs.append((kw.arg, text))
    return tuple(pairs)
