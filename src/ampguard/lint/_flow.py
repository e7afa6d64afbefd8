"""Control-flow-aware ordering inside one function body.

The AMP step is a short protocol: ``scale(loss).backward()`` -> ``unscale_`` -> clip -> ``step`` ->
``update``. This module turns a function body into *events* of that protocol (in evaluation
order) and interprets the statements over them: branches are joined, loops run to a fixed point,
``break``/``continue``/``return`` go where Python sends them, and calls to helpers are followed
(their parameters renamed to the caller's arguments; in project mode also helpers of other files).
A test that stays fixed (``if use_fp16:``, ``if scaler is not None:``) is remembered along each
path, so a path never takes both of its branches. Each rule supplies the state it tracks and how
an event changes it (an :class:`Analysis`).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

from ampguard.lint._events import Event, Events, header
from ampguard.lint._inert import silent
from ampguard.lint._memo import NOTHING, FlowMemo, Reads, Touched, expand, hidden, strip, untouched
from ampguard.lint._paths import MAX_PATHS, condition, heads, stored_heads

__all__ = ["Analysis", "Env", "Event", "Events", "FlowMemo", "Interpreter", "OutOfBudget"]

_MAX_LOOP_ROUNDS = 8
_COMPACT_ABOVE = 4  # assumption sets kept before the exact merges are tried
_MAX_INLINE_DEPTH = 3


class OutOfBudget(Exception):
    """The body is too large to interpret; the caller drops the unit's findings and says so.

    ``reason`` is ``"paths"`` (more than :data:`MAX_PATHS` assumption sets that cannot be merged
    without inventing paths) or ``"events"`` (too many events interpreted).
    """

    def __init__(self, reason: str = "events") -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Env:
    """How the interpreter is running: recording findings or not, the helper-call stack, and the
    events of the file whose statements run (a helper may live in another file)."""

    record: bool
    rename_map: dict[str, str] = field(default_factory=dict)
    active: tuple[ast.AST, ...] = ()
    events: Events | None = None

    @overload
    def rename(self, key: str) -> str: ...
    @overload
    def rename(self, key: None) -> None: ...

    def rename(self, key: str | None) -> str | None:
        """The caller's spelling of a key used inside an inlined helper."""
        if key is None or not self.rename_map:
            return key
        head, dot, rest = key.partition(".")
        new = self.rename_map.get(head)
        return key if new is None else new + dot + rest

    def quiet(self) -> Env:
        return Env(False, self.rename_map, self.active, self.events)


class Analysis(Protocol):
    """What a flow rule tracks: a state lattice and an event transfer."""

    def join(self, a: Any, b: Any) -> Any: ...

    def apply(self, state: Any, event: Event, env: Env) -> Any: ...


# The interpreter's own state: one analysis state per set of path assumptions (see _paths),
# or None where no path reaches.
Paths = dict[frozenset, Any]


@dataclass
class _Out:
    out: Paths | None = None
    brk: Paths | None = None
    cont: Paths | None = None
    ret: Paths | None = None


class Interpreter:
    """Runs an :class:`Analysis` over statement lists; ``None`` is the unreachable state.

    Findings are judged on the state joined over the paths that can reach a statement; paths are
    kept apart only to know which can (see :mod:`ampguard.lint._paths`).
    """

    def __init__(
        self,
        events: Events,
        analysis: Analysis,
        budget: int = 50_000,
        memo: FlowMemo | None = None,
    ) -> None:
        self.events = events
        self.analysis = analysis
        self.budget = budget
        self._heads: dict[str, set[str]] = {}
        # helper calls already interpreted: (helper, arguments, call depth, file, recording,
        # paths in, less the assumptions it does not read) -> paths out (the depth, not the
        # callers: a helper reached from two units at one depth exits the same way; only a call
        # cycle, cut where it meets itself, could tell them apart, and either answer is a sound
        # one). Shared by the interpreters of one analysis (``memo``), so a ``train()`` called
        # from many places is interpreted once per distinct entry state (see
        # ampguard.lint._memo); the owner drops it when a unit runs out of budget (with its
        # findings).
        self.memo = FlowMemo() if memo is None else memo
        self.reads = Reads()  # the helpers being interpreted, and what each has read

    def _merge(self, a: Any, b: Any) -> Any:
        if a is None:
            return b
        return a if b is None else self.analysis.join(a, b)

    def join(self, *states: Any) -> Any:
        """Join analysis states (``None``: unreachable)."""
        result = None
        for state in states:
            result = self._merge(result, state)
        return result

    def _pjoin(self, *states: Paths | None) -> Paths | None:
        result: Paths | None = None
        for state in states:
            if not state:
                continue
            if result is None:
                result = dict(state)
                continue
            for key, value in state.items():
                result[key] = self._merge(result.get(key), value)
        if result is not None and len(result) > _COMPACT_ABOVE:
            result = _compact(result, self._merge)
            if len(result) > MAX_PATHS:
                raise OutOfBudget("paths")
        return result

    def _flat(self, paths: Paths | None) -> Any:
        if not paths:
            return None
        merged = None
        for value in paths.values():
            merged = self._merge(merged, value)
        return merged

    def body(self, stmts: list[ast.stmt], state: Any, record: bool) -> tuple[Any, Any]:
        """Run ``stmts``; returns (state at the end or a ``return``, state at ``continue``)."""
        start: Paths | None = None if state is None else {frozenset(): state}
        out = self._block(stmts, start, Env(record, events=self.events))
        return self._flat(self._pjoin(out.out, out.ret)), self._flat(out.cont)

    def _event(self, paths: Paths, event: Event, env: Env) -> Paths:
        if len(paths) == 1:
            [(key, value)] = paths.items()
            return {key: self.analysis.apply(value, event, env)}
        if env.record:  # judged on what any reaching path may carry
            self.analysis.apply(self._flat(paths), event, env)
        quiet = env.quiet()
        return {key: self.analysis.apply(value, event, quiet) for key, value in paths.items()}

    def _apply(self, state: Paths | None, stmt: ast.AST, env: Env) -> Paths | None:
        events = env.events or self.events
        for event in events.of(stmt):
            if state is None:
                return None
            self.budget -= len(state)
            if self.budget < 0:
                raise OutOfBudget
            if event.kind == "pstep":  # step on a parameter: a scaler if the caller passed one
                kind = "sstep" if env.rename(event.key) in self.events.scalers else "ostep"
                event = dataclasses.replace(event, kind=kind)
            if event.kind == "call":
                state = self._inline(state, event, env)
            else:
                state = self._event(state, event, env)
        if state is not None and (self.reads.frames or _holds_facts(state)):
            stored = stored_heads(stmt, header)
            if stored:
                state = self._forget(state, stored, env)
        return state

    def _forget(self, state: Paths, names: frozenset[str] | set[str], env: Env) -> Paths:
        """Drop the assumptions that read a name just assigned (inside a helper: noted as read,
        also where no path holds one)."""
        if env.rename_map:  # a helper's locals are not the caller's names; its parameters are
            names = {env.rename_map[n].split(".", 1)[0] for n in names if n in env.rename_map}
            if not names:
                return state
        if self.reads.frames:
            self.reads.assigned(names)
        if not _holds_facts(state):
            return state
        out: Paths = {}
        changed = False
        for key, value in state.items():
            kept = frozenset(a for a in key if not (self._key_heads(a[0]) & names))
            changed = changed or kept != key
            out[kept] = self._merge(out.get(kept), value)
        return out if changed else state

    def _key_heads(self, key: str) -> set[str]:
        found = self._heads.get(key)
        if found is None:
            found = self._heads[key] = heads(key)
        return found

    def _inline(self, state: Paths, event: Event, env: Env) -> Paths | None:
        helper: Any = event.target
        if helper in env.active or len(env.active) >= _MAX_INLINE_DEPTH:
            return state
        mapping = {name: env.rename(text) or text for name, text in event.mapping}
        events = env.events or self.events
        if event.owner is not None and event.owner is not events.model:
            events = self.events.sub(event.owner)
        inner = Env(env.record, mapping, (*env.active, helper), events)
        stores = events.inert(event)  # no events inside: only what it assigns matters
        if stores is not None:
            return self._forget(state, stores, inner) if stores else state
        if inner.record and silent(helper):  # no event inside: nothing to record there
            inner = Env(False, inner.rename_map, inner.active, inner.events)
        return self._interpret(helper, state, inner)

    def _interpret(self, helper: Any, state: Paths, env: Env) -> Paths | None:
        """``helper``'s exit from ``state``, memoised on the entry paths less the assumptions
        every path holds and the helper does not read (see :mod:`ampguard.lint._memo`)."""
        context = (
            id(helper),
            tuple(sorted(env.rename_map.items())),
            len(env.active),
            id(env.events),
        )
        facts = hidden(state, self.memo.reads.get(context), self._key_heads)
        while True:
            entry = strip(state, facts)
            key = _memo_key(context, env.record, entry)
            found = None if key is None else self.memo.exits.get(key)
            if found is None and key is not None and not env.record:
                found = self.memo.exits.get((*key[:4], True, key[5]))  # the same paths
            if found is not None:  # same entry: same exit, its findings already recorded
                result, read = found
                if untouched(facts, read, self._key_heads) == facts:
                    self.reads.replay(read)
                    return expand(result, facts)
                self.memo.learn(context, read)  # not run with these hidden: keep them
                facts = hidden(state, self.memo.reads[context], self._key_heads)
                continue
            frame, budget = self.reads.push(facts, self._key_heads), self.budget
            try:
                out = self._block(helper.body, entry, env)
            except Touched as error:
                if error.frame is not frame:
                    raise
                self.budget = budget  # the void run's work is not counted
                self.memo.learn(context, error.read)
                facts = hidden(state, self.memo.reads[context], self._key_heads)
                continue
            finally:
                self.reads.pop(frame)
            result = self._pjoin(out.out, out.ret)
            self.memo.learn(context, frame.read())
            if key is not None:
                self.memo.exits[key] = (result, frame.read())
            return expand(result, facts)

    def _block(self, stmts: list[ast.stmt], state: Paths | None, env: Env) -> _Out:
        acc = _Out()
        for stmt in stmts:
            if state is None:
                break
            step = _STATEMENTS.get(type(stmt))
            if step is None:
                state = self._apply(state, stmt, env)
                if isinstance(stmt, ast.Return):
                    acc.ret, state = self._pjoin(acc.ret, state), None
                elif isinstance(stmt, ast.Raise):
                    state = None
                elif isinstance(stmt, ast.Break):
                    acc.brk, state = self._pjoin(acc.brk, state), None
                elif isinstance(stmt, ast.Continue):
                    acc.cont, state = self._pjoin(acc.cont, state), None
                continue
            sub = step(self, stmt, state, env)
            state = sub.out
            acc.brk, acc.cont = self._pjoin(acc.brk, sub.brk), self._pjoin(acc.cont, sub.cont)
            acc.ret = self._pjoin(acc.ret, sub.ret)
        acc.out = state
        return acc

    def _if(self, stmt: ast.If, state: Paths | None, env: Env) -> _Out:
        state = self._apply(state, stmt, env)
        fixed = condition(stmt.test, env.rename_map) if state is not None else None
        if fixed is not None and self.reads.frames:
            self.reads.tested(fixed[0])
        if fixed is None or state is None:
            yes = no = state
        else:
            yes, no = self._split(state, fixed)
        a, b = self._block(stmt.body, yes, env), self._block(stmt.orelse, no, env)
        return _Out(
            self._pjoin(a.out, b.out),
            self._pjoin(a.brk, b.brk),
            self._pjoin(a.cont, b.cont),
            self._pjoin(a.ret, b.ret),
        )

    def _split(self, state: Paths, fixed: tuple[str, bool]) -> tuple[Paths | None, Paths | None]:
        """The paths that enter each branch of a fixed test, each set holding its assumption.

        Sets that differ only in this test land on one set: ``{A}`` (a path that has not read the
        test yet, as on a loop's first iteration) and ``{A, x}`` both enter the ``x`` branch as
        ``{A, x}``, so their states are joined there, never one put in place of the other (that
        would drop a path that reaches the branch).
        """
        key, value = fixed
        yes: Paths = {}
        no: Paths = {}

        def add(side: Paths, facts: frozenset, analysis_state: Any) -> None:
            side[facts] = self._merge(side.get(facts), analysis_state)

        for facts, analysis_state in state.items():
            if (key, value) in facts:
                add(yes, facts, analysis_state)
            elif (key, not value) in facts:
                add(no, facts, analysis_state)
            else:
                add(yes, facts | {(key, value)}, analysis_state)
                add(no, facts | {(key, not value)}, analysis_state)
        return self._pjoin(yes), self._pjoin(no)

    def _loop(self, stmt: Any, state: Paths | None, env: Env) -> _Out:
        is_while = isinstance(stmt, ast.While)
        if not is_while:
            state = self._apply(state, stmt, env)
        targets = stored_heads(stmt, header) if not is_while else frozenset()
        head, last = self._settle(stmt, state, env, targets)
        if last is None or env.record:  # a quiet pass from the settled head is the last round
            entry = self._enter(head, stmt, env, targets)
            last = entry, self._block(stmt.body, entry, env)
        entry, body = last
        forever = is_while and isinstance(stmt.test, ast.Constant) and bool(stmt.test.value)
        normal = None if forever else entry
        orelse = self._block(stmt.orelse, normal, env) if normal is not None else _Out()
        return _Out(
            self._pjoin(orelse.out, body.brk),
            orelse.brk,
            orelse.cont,
            self._pjoin(body.ret, orelse.ret),
        )

    def _settle(
        self, stmt: Any, state: Paths | None, env: Env, targets: frozenset[str]
    ) -> tuple[Paths | None, tuple[Paths | None, _Out] | None]:
        """The paths at the loop's head once a quiet round leaves them as they were, and that
        round's (entry, body) (``None``: the rounds ran out first); memoised per loop, entry
        paths, helper stack, mapping and file (see :mod:`ampguard.lint._memo`)."""
        key = _loop_key(stmt, env, state)
        found = None if key is None else self.memo.loops.get(key)
        if found is not None:
            head, last, read = found
            self.reads.replay(read)
            return head, last
        frame = self.reads.push(frozenset(), self._key_heads) if self.reads.frames else None
        quiet = env.quiet()
        head, last = state, None
        try:
            for _ in range(_MAX_LOOP_ROUNDS):
                entry = self._enter(head, stmt, quiet, targets)
                body = self._block(stmt.body, entry, quiet)
                new_head = self._pjoin(state, body.out, body.cont)
                if new_head == head:
                    last = entry, body
                    break
                head = new_head
        finally:
            if frame is not None:
                self.reads.pop(frame)
        if key is not None:
            self.memo.loops[key] = head, last, NOTHING if frame is None else frame.read()
        return head, last

    def _enter(
        self, head: Paths | None, stmt: ast.AST, env: Env, targets: frozenset[str]
    ) -> Paths | None:
        """One iteration's entry: a ``while`` test runs; a ``for`` target is assigned anew."""
        if isinstance(stmt, ast.While):
            return self._apply(head, stmt, env)
        if head is not None and targets and (self.reads.frames or _holds_facts(head)):
            return self._forget(head, targets, env)
        return head

    def _with(self, stmt: ast.With, state: Paths | None, env: Env) -> _Out:
        return self._block(stmt.body, self._apply(state, stmt, env), env)

    def _try(self, stmt: ast.Try, state: Paths, env: Env) -> _Out:
        body = self._block(stmt.body, state, env)
        handler_entry = self._pjoin(state, body.out)
        parts = [self._block(stmt.orelse, body.out, env)] if body.out is not None else []
        parts += [self._block(h.body, handler_entry, env) for h in stmt.handlers]
        out = _Out(None, body.brk, body.cont, body.ret)
        for part in parts:
            out.out = self._pjoin(out.out, part.out)
            out.brk, out.cont = self._pjoin(out.brk, part.brk), self._pjoin(out.cont, part.cont)
            out.ret = self._pjoin(out.ret, part.ret)
        if stmt.finalbody:
            fin = self._block(stmt.finalbody, out.out, env)
            out.out = fin.out
        return out

    def _match(self, stmt: Any, state: Paths | None, env: Env) -> _Out:
        state = self._apply(state, stmt, env)
        out = _Out(state)  # no case may match
        for case in stmt.cases:
            part = self._block(case.body, state, env)
            out.out, out.brk = self._pjoin(out.out, part.out), self._pjoin(out.brk, part.brk)
            out.cont, out.ret = self._pjoin(out.cont, part.cont), self._pjoin(out.ret, part.ret)
        return out

    def _skip(self, stmt: ast.AST, state: Paths, env: Env) -> _Out:
        return _Out(state)  # nested def/class: their bodies do not run here


def _memo_key(context: tuple, record: bool, state: Paths) -> tuple | None:
    """What an inlined helper's exit depends on (``None``: a state that cannot be hashed)."""
    try:
        return (*context, record, frozenset(state.items()))
    except TypeError:
        return None


def _loop_key(stmt: ast.AST, env: Env, state: Paths | None) -> tuple | None:
    """What a loop's settled head depends on (``None``: no paths, or unhashable ones)."""
    if state is None:
        return None
    try:
        rename = tuple(sorted(env.rename_map.items()))
        return (id(stmt), rename, env.active, id(env.events), frozenset(state.items()))
    except TypeError:
        return None


def _holds_facts(state: Paths) -> bool:
    """Some path of ``state`` holds an assumption (else there is nothing to forget)."""
    return len(state) > 1 or frozenset() not in state


def _compact(paths: Paths, join: Callable[[Any, Any], Any]) -> Paths:
    """Merge assumption sets only where no path is invented (``join`` joins two states).

    Two sets with the same analysis state merge when they differ in one assumption only
    (``{A, x}`` and ``{A, not x}`` are ``{A}``: the state reached both branches of ``x``), or
    when one holds the other (``{A}`` already stands for the paths of ``{A, B}``). Merging sets
    with different states, or dropping an assumption one state depends on, would let a path
    reach a branch it never takes: that is never done; the caller stops instead
    (:class:`OutOfBudget`).
    """
    out = dict(paths)
    changed = True
    while changed and len(out) > 1:
        changed = False
        for key in sorted(out, key=len):
            if key not in out:
                continue
            value = out[key]
            for other in [o for o in out if key < o and out[o] == value]:
                del out[other]
                changed = True
            for fact in key:
                smaller = key - {fact}
                twin = smaller | {(fact[0], not fact[1])}
                if twin in out and out[twin] == value:
                    del out[key], out[twin]
                    out[smaller] = value if smaller not in out else join(out[smaller], value)
                    changed = True
                    break
            if changed:
                break
    return out


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
