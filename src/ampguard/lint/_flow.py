"""Control-flow-aware ordering inside one function body.

The AMP step is a short protocol: ``scale(loss).backward()`` -> ``unscale_`` -> clip -> ``step`` ->
``update``. This module turns a function body into *events* of that protocol (in evaluation
order) and interprets the statements over them: branches are joined, loops run to a fixed point,
``break``/``continue``/``return`` go where Python sends them, and calls to helpers defined in the
same file are followed (their parameters renamed to the caller's arguments). Each rule supplies
the state it tracks and how an event changes it (an :class:`Analysis`).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ampguard.lint._context import is_scheduler_like, scaler_state
from ampguard.lint._model import FUNCS, FileModel
from ampguard.lint._names import CLIPS, dotted

__all__ = ["Analysis", "Env", "Event", "Events", "Interpreter", "OutOfBudget"]

_MAX_LOOP_ROUNDS = 8
_MAX_INLINE_DEPTH = 3


@dataclass(frozen=True)
class Event:
    """One step of the AMP protocol found in the source."""

    kind: str  # bwd, bwd_scaled, unscale, sstep, pstep, ostep, update, zero, clip, opaque, call
    node: ast.AST
    key: str | None = None  # scaler (or optimizer, for ostep) text
    arg: str | None = None  # optimizer text of scaler.step(opt)
    target: ast.AST | None = None  # helper ``def`` for kind == "call"
    mapping: tuple[tuple[str, str], ...] = ()  # helper parameter -> caller argument text


class Events:
    """Extracts (and caches) the events of statements in one file."""

    def __init__(self, model: FileModel) -> None:
        self.model = model
        self.scalers = model.scaler_keys
        self._cache: dict[int, list[Event]] = {}

    def of(self, stmt: ast.AST) -> list[Event]:
        """Events a simple statement (or a compound statement's header) produces, in order."""
        key = id(stmt)
        found = self._cache.get(key)
        if found is None:
            found = [ev for call in _calls_in(_header(stmt)) for ev in self._call(call)]
            self._cache[key] = found
        return found

    def _call(self, call: ast.Call) -> list[Event]:
        func = call.func
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
            if attr == "update" and (key in self.scalers or (
                    not call.args and not call.keywords and self._is_parameter(func.value))):
                return [Event("update", call, key)]
            if attr == "zero_grad":
                return [Event("zero", call)]
        if self.model.call_name(call) in CLIPS:
            return [Event("clip", call)]
        helper = self._helper(call)
        if helper is not None:
            return [Event("call", call, target=helper, mapping=_mapping(helper, call))]
        return [Event("opaque", call, key) for key in self._opaque_keys(call)]

    def _is_parameter(self, node: ast.AST) -> bool:
        """``node`` is a bare parameter of its function (a helper's ``scaler`` argument)."""
        if not isinstance(node, ast.Name):
            return False
        func = self.model.function_of(node)
        args = func.args if func is not None else None
        return args is not None and any(
            a.arg == node.id for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))

    def _scaled_source(self, recv: ast.AST) -> str | None:
        if isinstance(recv, ast.Name):  # scaled = scaler.scale(loss); scaled.backward()
            value = self.model.single_value(recv)
            recv = value if value is not None else recv
        if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Attribute) \
                and recv.func.attr == "scale":
            key = dotted(recv.func.value)
            if key not in self.scalers:
                return None
            ctor = self.model.ctor_of(key)  # GradScaler(enabled=False).scale(x) is just x
            return None if ctor is not None and scaler_state(self.model, ctor) == "off" else key
        return None

    def _helper(self, call: ast.Call) -> ast.AST | None:
        func = call.func
        if isinstance(func, ast.Name):
            found = self.model.binding(func.id, self.model.scope_of(call))
            if found and found[0] == "values" and len(found[1]) == 1:
                value = found[1][0]
                return value if isinstance(value, FUNCS) else None
            return None
        if isinstance(func, ast.Attribute) and dotted(func.value) == "self":
            cls = self.model.class_of(call)
            for stmt in cls.body if cls is not None else ():
                if isinstance(stmt, FUNCS) and stmt.name == func.attr:
                    return stmt
        return None

    def _opaque_keys(self, call: ast.Call) -> list[str]:
        args = [*call.args, *(kw.value for kw in call.keywords)]
        keys = [k for a in args if (k := dotted(a)) is not None and k in self.scalers]
        func = call.func
        if isinstance(func, ast.Attribute) and dotted(func.value) == "self":  # unresolved method
            keys.extend(k for k in self.scalers if k.startswith("self."))
        return keys


def _header(stmt: ast.AST) -> list[ast.AST]:
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
        children = list(ast.iter_child_nodes(node))
        stack.extend((c, False) for c in reversed(children))
    return out


def _mapping(helper: ast.AST, call: ast.Call) -> tuple[tuple[str, str], ...]:
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


class OutOfBudget(Exception):
    """The body is too large to interpret; the caller gives up on it (no findings)."""


@dataclass
class Env:
    """How the interpreter is running: recording findings or not, and the helper-call stack."""

    record: bool
    rename_map: dict[str, str] = field(default_factory=dict)
    active: tuple[ast.AST, ...] = ()

    def rename(self, key: str | None) -> str | None:
        """The caller's spelling of a key used inside an inlined helper."""
        if key is None or not self.rename_map:
            return key
        head, dot, rest = key.partition(".")
        new = self.rename_map.get(head)
        return key if new is None else new + dot + rest

    def quiet(self) -> Env:
        return Env(False, self.rename_map, self.active)


class Analysis(Protocol):
    """What a flow rule tracks: a state lattice and an event transfer."""

    def join(self, a: Any, b: Any) -> Any: ...

    def apply(self, state: Any, event: Event, env: Env) -> Any: ...


@dataclass
class _Out:
    out: Any = None
    brk: Any = None
    cont: Any = None
    ret: Any = None


class Interpreter:
    """Runs an :class:`Analysis` over statement lists; ``None`` is the unreachable state."""

    def __init__(self, events: Events, analysis: Analysis, budget: int = 50_000) -> None:
        self.events = events
        self.analysis = analysis
        self.budget = budget

    def join(self, *states: Any) -> Any:
        result = None
        for state in states:
            if state is None:
                continue
            result = state if result is None else self.analysis.join(result, state)
        return result

    def body(self, stmts: list[ast.stmt], state: Any, record: bool) -> tuple[Any, Any]:
        """Run ``stmts``; returns (state at the end or a ``return``, state at ``continue``)."""
        out = self._block(stmts, state, Env(record))
        return self.join(out.out, out.ret), out.cont

    def _apply(self, state: Any, stmt: ast.AST, env: Env) -> Any:
        for event in self.events.of(stmt):
            if state is None:
                return None
            self.budget -= 1
            if self.budget < 0:
                raise OutOfBudget
            if event.kind == "pstep":  # step on a parameter: a scaler if the caller passed one
                kind = "sstep" if env.rename(event.key) in self.events.scalers else "ostep"
                event = dataclasses.replace(event, kind=kind)
            if event.kind == "call":
                state = self._inline(state, event, env)
            else:
                state = self.analysis.apply(state, event, env)
        return state

    def _inline(self, state: Any, event: Event, env: Env) -> Any:
        helper = event.target
        if helper in env.active or len(env.active) >= _MAX_INLINE_DEPTH:
            return state
        mapping = {name: env.rename(text) or text for name, text in event.mapping}
        inner = Env(env.record, mapping, (*env.active, helper))
        out = self._block(helper.body, state, inner)
        return self.join(out.out, out.ret)

    def _block(self, stmts: list[ast.stmt], state: Any, env: Env) -> _Out:
        acc = _Out()
        for stmt in stmts:
            if state is None:
                break
            step = _STATEMENTS.get(type(stmt))
            if step is None:
                state = self._apply(state, stmt, env)
                if isinstance(stmt, ast.Return):
                    acc.ret, state = self.join(acc.ret, state), None
                elif isinstance(stmt, ast.Raise):
                    state = None
                elif isinstance(stmt, ast.Break):
                    acc.brk, state = self.join(acc.brk, state), None
                elif isinstance(stmt, ast.Continue):
                    acc.cont, state = self.join(acc.cont, state), None
                continue
            sub = step(self, stmt, state, env)
            state = sub.out
            acc.brk, acc.cont = self.join(acc.brk, sub.brk), self.join(acc.cont, sub.cont)
            acc.ret = self.join(acc.ret, sub.ret)
        acc.out = state
        return acc

    def _if(self, stmt: ast.If, state: Any, env: Env) -> _Out:
        state = self._apply(state, stmt, env)
        a, b = self._block(stmt.body, state, env), self._block(stmt.orelse, state, env)
        return _Out(self.join(a.out, b.out), self.join(a.brk, b.brk), self.join(a.cont, b.cont),
                    self.join(a.ret, b.ret))

    def _loop(self, stmt: ast.For | ast.While, state: Any, env: Env) -> _Out:
        is_while = isinstance(stmt, ast.While)
        if not is_while:
            state = self._apply(state, stmt, env)
        head = state
        for _ in range(_MAX_LOOP_ROUNDS):
            entry = self._apply(head, stmt, env.quiet()) if is_while else head
            body = self._block(stmt.body, entry, env.quiet())
            new_head = self.join(state, body.out, body.cont)
            if new_head == head:
                break
            head = new_head
        entry = self._apply(head, stmt, env) if is_while else head
        body = self._block(stmt.body, entry, env)
        forever = is_while and isinstance(stmt.test, ast.Constant) and bool(stmt.test.value)
        normal = None if forever else entry
        orelse = self._block(stmt.orelse, normal, env) if normal is not None else _Out()
        return _Out(self.join(orelse.out, body.brk), orelse.brk, orelse.cont,
                    self.join(body.ret, orelse.ret))

    def _with(self, stmt: ast.With, state: Any, env: Env) -> _Out:
        return self._block(stmt.body, self._apply(state, stmt, env), env)

    def _try(self, stmt: ast.Try, state: Any, env: Env) -> _Out:
        body = self._block(stmt.body, state, env)
        handler_entry = self.join(state, body.out)
        parts = [self._block(stmt.orelse, body.out, env)] if body.out is not None else []
        parts += [self._block(h.body, handler_entry, env) for h in stmt.handlers]
        out = _Out(None, body.brk, body.cont, body.ret)
        for part in parts:
            out.out = self.join(out.out, part.out)
            out.brk, out.cont = self.join(out.brk, part.brk), self.join(out.cont, part.cont)
            out.ret = self.join(out.ret, part.ret)
        if stmt.finalbody:
            fin = self._block(stmt.finalbody, out.out, env)
            out.out = fin.out
        return out

    def _match(self, stmt: ast.AST, state: Any, env: Env) -> _Out:
        state = self._apply(state, stmt, env)
        out = _Out(state)  # no case may match
        for case in stmt.cases:
            part = self._block(case.body, state, env)
            out.out, out.brk = self.join(out.out, part.out), self.join(out.brk, part.brk)
            out.cont, out.ret = self.join(out.cont, part.cont), self.join(out.ret, part.ret)
        return out

    def _skip(self, stmt: ast.AST, state: Any, env: Env) -> _Out:
        return _Out(state)  # nested def/class: their bodies do not run here


_STATEMENTS: dict[type, Callable[..., _Out]] = {
    ast.If: Interpreter._if,
    ast.For: Interpreter._loop,
    ast.AsyncFor: Interpreter._loop,
    ast.While: Interpreter._loop,
    ast.With: Interpreter._with,
    ast.AsyncWith: Interpreter._with,
    ast.Try: Interpreter._try,
    ast.FunctionDef: Interpreter._skip,
    ast.AsyncFunctionDef: Interpreter._skip,
    ast.ClassDef: Interpreter._skip,
}
if hasattr(ast, "TryStar"):
    _STATEMENTS[ast.TryStar] = Interpreter._try
if hasattr(ast, "Match"):
    _STATEMENTS[ast.Match] = Interpreter._match
