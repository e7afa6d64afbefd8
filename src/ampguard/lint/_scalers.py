"""GradScaler facts of a file: where scalers are built, what names hold them, whether one is used.

Mixed into :class:`ampguard.lint._model.FileModel`, whose ``by_terminal``, ``call_name``,
``binding``, ``scope_of`` and ``ancestors`` these read.
"""

from __future__ import annotations

import ast
from functools import cached_property
from typing import Any

from ampguard.lint._calls import argument_for, keyword, resolve_def
from ampguard.lint._calls import constant as _constant
from ampguard.lint._names import GRAD_SCALERS, dotted, terminal
from ampguard.lint._tree import walk

__all__ = ["ScalerFacts", "scaler_state"]

_CTOR_NAMES = ("GradScaler", "ShardedGradScaler")


class ScalerFacts:
    """Cached GradScaler facts (a mixin of ``FileModel``)."""

    by_terminal: dict[str, list[ast.Call]]
    call_name: Any
    binding: Any
    scope_of: Any
    ancestors: Any
    calls_to: Any
    single_value: Any

    @cached_property
    def scaler_ctors(self) -> list[ast.Call]:
        """Calls that construct a GradScaler (any spelling, resolved through imports)."""
        out = [
            c
            for c in self.calls_to(GRAD_SCALERS)
            if terminal(c.func) not in ("GradScaler", "ShardedGradScaler")
        ]
        for name in ("GradScaler", "ShardedGradScaler"):
            for call in self.by_terminal.get(name, ()):
                qual = self.call_name(call)
                if qual is not None and (qual in GRAD_SCALERS or qual.endswith("." + name)):
                    out.append(call)
                elif qual is None and self._unbound(call.func):
                    out.append(call)
        out.extend(self._factory_calls)
        return out

    @cached_property
    def _factory_calls(self) -> list[ast.Call]:
        """``scaler = create_grad_scaler(...)`` where the project's own helper (in another file)
        builds the GradScaler: the call stands for the construction."""
        if getattr(self, "project", None) is None:
            return []
        self._factories: dict[int, tuple[Any, ast.Call, ast.AST]] = {}
        out: list[ast.Call] = []
        for call in self._scaler_named_calls():
            found = resolve_def(self, call.func)
            if found is None or found[0] is self:
                continue
            owner, func = found
            ctor = _built_in(owner, func)
            if ctor is not None:
                self._factories[id(call)] = (owner, ctor, func)
                out.append(call)
        return out

    def _factories_map(self) -> dict[int, Any]:
        return getattr(self, "_factories", {})

    def factory_of(self, call: ast.Call) -> tuple[Any, ast.Call, ast.AST] | None:
        """(file model, GradScaler construction, helper def) behind a project factory call."""
        if getattr(self, "project", None) is None:
            return None
        self.scaler_ctors  # noqa: B018 - fills the factory map
        return self._factories_map().get(id(call))

    def _scaler_named_calls(self) -> list[ast.Call]:
        """Calls assigned to a scaler-like name (``scaler``, ``self.grad_scaler``)."""
        scopes: Any = getattr(self, "scopes", {})
        out: list[ast.Call] = []
        for scope in scopes.values():
            for name, values in scope.assigns.items():
                if _scaler_word(name):
                    out.extend(v for v in values if isinstance(v, ast.Call))
        for key, values in getattr(self, "attr_bindings", {}).items():
            if _scaler_word(key):
                out.extend(v for v in values if isinstance(v, ast.Call))
        for target, call in getattr(self, "unpacked_calls", ()):
            if any(_scaler_word(dotted(elt) or "") for elt in target.elts):
                out.append(call)  # model, optimizer, scaler = build_training(cfg)
        return [c for c in out if terminal(c.func) not in ("GradScaler", "ShardedGradScaler")]

    def _unbound(self, func: ast.AST) -> bool:
        while isinstance(func, ast.Attribute):
            func = func.value
        return isinstance(func, ast.Name) and self.binding(func.id, self.scope_of(func)) is None

    @cached_property
    def scaler_keys(self) -> frozenset[str]:
        """Texts (``scaler``, ``self.scaler``) that name a GradScaler in this file."""
        keys: set[str] = set(self.ctor_targets)
        keys.update(self._evidence_keys)
        for name in ("step", "update", "scale", "get_scale", "unscale_"):
            for call in self.by_terminal.get(name, ()):
                key = dotted(call.func.value) if isinstance(call.func, ast.Attribute) else None
                if key is not None and _scaler_word(key):
                    keys.add(key)
        return frozenset(keys)

    @cached_property
    def ctor_targets(self) -> dict[str, ast.Call]:
        out: dict[str, ast.Call] = {}
        for call in self.scaler_ctors:
            node: ast.AST = call
            for anc in self.ancestors(call):
                if isinstance(anc, (ast.IfExp, ast.BoolOp)):
                    node = anc
                    continue
                if isinstance(anc, ast.Assign):
                    for target in anc.targets:
                        if (key := dotted(target)) is not None:
                            out.setdefault(key, call)
                        elif isinstance(target, (ast.Tuple, ast.List)) and anc.value is call:
                            for elt in target.elts:  # a factory's (model, opt, scaler)
                                if (key := dotted(elt)) is not None and _scaler_word(key):
                                    out.setdefault(key, call)
                elif isinstance(anc, (ast.AnnAssign, ast.NamedExpr)) and anc.value is node:
                    if (key := dotted(anc.target)) is not None:
                        out.setdefault(key, call)
                break
        return out

    @cached_property
    def _evidence_keys(self) -> frozenset[str]:
        keys = set()
        for call in self.by_terminal.get("unscale_", ()):
            if isinstance(call.func, ast.Attribute) and (key := dotted(call.func.value)):
                keys.add(key)
        for call in self.by_terminal.get("backward", ()):
            inner = call.func.value if isinstance(call.func, ast.Attribute) else None
            if (
                isinstance(inner, ast.Call)
                and isinstance(inner.func, ast.Attribute)
                and inner.func.attr == "scale"
                and (key := dotted(inner.func.value))
            ):
                keys.add(key)
        return frozenset(keys)

    def ctor_of(self, key: str) -> ast.Call | None:
        """The GradScaler construction assigned to ``key``, if any."""
        return self.ctor_targets.get(key)

    @cached_property
    def uses_grad_scaler(self) -> bool:
        """The file constructs a GradScaler that is not switched off, or uses one unmistakably."""
        if any(scaler_state(self, call) != "off" for call in self.scaler_ctors):
            return True
        return bool(self._evidence_keys)


def scaler_state(model: ScalerFacts, call: ast.Call) -> str:
    """``"on"``, ``"off"``, ``"gated"`` (switched on only for fp16) or ``"unknown"``."""
    factory = model.factory_of(call)
    if factory is not None:  # scaler = create_grad_scaler(enabled=...) from the project
        owner, ctor, func = factory
        state = scaler_state(owner, ctor)
        node = keyword(ctor, "enabled")
        if state == "unknown" and isinstance(node, ast.Name):
            arg = argument_for(func, call, node.id)
            return _enabled_state(model, arg) if arg is not None else state
        return state
    qual = model.call_name(call) or ""
    position = 4 if qual.startswith(("torch.cuda.", "torch.cpu.")) else 5
    return _enabled_state(model, keyword(call, "enabled", position))


def _enabled_state(model: ScalerFacts, node: ast.AST | None) -> str:
    if node is None:
        return "on"
    value = _constant(node)
    if value is True:
        return "on"
    if value is False:
        return "off"
    text = ast.unparse(node).lower()
    if isinstance(node, (ast.Name, ast.Attribute)):
        bound = model.single_value(node)
        if bound is not None:
            text += " " + ast.unparse(bound).lower()
    if any(word in text for word in ("float16", "fp16", "half", "'16'", '"16"', "== 16")):
        return "gated"
    return "unknown"


def _scaler_word(key: str) -> bool:
    last = key.rsplit(".", 1)[-1].lower()
    return "scaler" in last and "sched" not in last


def _built_in(model: Any, func: ast.AST) -> ast.Call | None:
    """The GradScaler a helper (a ``def``, or any method of a class) constructs, if any."""
    for node in walk(func):
        if isinstance(node, ast.Call) and terminal(node.func) in _CTOR_NAMES:
            qual = model.call_name(node)
            if qual is None or qual in GRAD_SCALERS or qual.endswith(".GradScaler"):
                return node
    return None
