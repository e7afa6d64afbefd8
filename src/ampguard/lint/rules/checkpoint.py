"""AG205 (checkpoint without the scaler's state) and AG208 (unsafe ``torch.load``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from ampguard.findings import Finding
from ampguard.lint._context import is_model_like, is_scheduler_like, keyword
from ampguard.lint._model import FileModel
from ampguard.lint._names import dotted, terminal
from ampguard.lint._reach import reaching_assignment
from ampguard.lint.rules._base import Context, Rule
from ampguard.lint.rules._savers import builder_calls, save_sites

__all__ = ["AG205", "AG208", "WEIGHTS_ONLY_DEFAULT_SINCE"]

WEIGHTS_ONLY_DEFAULT_SINCE = (2, 6)  # torch.load(weights_only=True) became the default in 2.6
_SAVE, _LOAD = frozenset({"torch.save"}), frozenset({"torch.load"})
_Entries = list[tuple[str | None, ast.AST]]


def _check_checkpoint(ctx: Context) -> Iterator[Finding]:
    """One finding per checkpoint dict (at its first save, every save line listed)."""
    model = ctx.model
    if not model.uses_grad_scaler:
        return
    sites = save_sites(ctx)
    site_ids = {id(call) for call, _ in sites}
    groups: dict[int, list[Any]] = {}  # dict identity -> [first call, entries, kinds, lines, via]
    for call, obj in sites:
        found = _entries(model, obj, call, site_ids)
        entries: _Entries
        if found is None:
            entries, identity = ([(None, obj)] if obj is not None else []), id(call)
        else:
            entries, identity = found
        _group(groups, identity, call, entries, _kinds(model, entries), None)
    for call, owner, helper, dict_node, entries in built_sites(ctx):
        _group(groups, id(dict_node), call, entries, _kinds(owner, entries), (owner, helper))
    for call, entries in checkpointer_sites(model):
        _group(groups, id(call), call, entries, _object_kinds(model, entries), None)
    if any("scaler" in group[2] for group in groups.values()):
        return  # the scaler's state is saved (maybe in a file of its own): the run can resume it
    scaler = min(model.scaler_keys, key=lambda k: (k.count("."), len(k)), default="scaler")
    for call, entries, kinds, lines, via in groups.values():
        if not ({"model", "optimizer"} <= kinds and "unknown" not in kinds):
            continue
        where = f" (saved at lines {', '.join(map(str, lines))})" if len(lines) > 1 else ""
        built = ""
        if via is not None:
            owner, helper = via
            built = f" built by {helper.name}() ({_short(owner.path)}:{helper.lineno})"
        yield ctx.finding(
            AG205,
            call,
            f"checkpoint{built} saves the model and optimizer but not the GradScaler{where}: "
            "a resumed run restarts the loss scale at its initial value (more skipped "
            "steps, different numerics)",
            keys=sorted(k for k, _ in entries if k),
            save_lines=lines,
            fix=_fix(call, scaler),
        )


def _fix(call: ast.Call, scaler: str) -> str:
    """AG205's advice in the code's own names: its scaler, and the dict (or checkpointer) that
    is saved."""
    if not _is_save(call):  # a checkpointer object built without the scaler
        return (
            f"pass the scaler to {terminal(call.func)}(..., scaler={scaler}) (or add it as a "
            "checkpointable) so its state is saved and restored with the model's"
        )
    obj = call.args[0] if call.args else keyword(call, "obj")
    name = dotted(obj) if obj is not None else None
    if name is None or isinstance(obj, ast.Dict):
        return (
            f"add 'scaler': {scaler}.state_dict() to the saved dict and call "
            f"{scaler}.load_state_dict(checkpoint['scaler']) when resuming"
        )
    return (
        f"add {name}['scaler'] = {scaler}.state_dict() before the save and call "
        f"{scaler}.load_state_dict(checkpoint['scaler']) when resuming"
    )


def _is_save(call: ast.Call) -> bool:
    name = terminal(call.func) or ""
    return "checkpointer" not in name.lower()


# a checkpointer object: it saves the model and each object handed to it (fvcore/detectron2
# ``Checkpointer(model, save_dir, optimizer=..., scheduler=...)``, ``DetectionCheckpointer``)
_CHECKPOINTERS = ("Checkpointer",)
_NOT_STATE = frozenset({"save_dir", "save_to_disk", "path", "dirpath", "output_dir", "max_keep"})


def checkpointer_sites(model: FileModel) -> list[tuple[ast.Call, _Entries]]:
    """Checkpointer objects built in this file, with what they were handed (key, object): the
    first positional argument is the model, the others are folders and flags."""
    out = []
    for call in model.calls:
        name = terminal(call.func) or ""
        if not name.endswith(_CHECKPOINTERS) or not call.args:
            continue
        if any(kw.arg is None for kw in call.keywords):
            continue  # **checkpointables: cannot be known
        entries: _Entries = [("model", call.args[0])]
        entries += [(kw.arg, kw.value) for kw in call.keywords if kw.arg not in _NOT_STATE]
        out.append((call, entries))
    return out


def _object_kinds(model: FileModel, entries: _Entries) -> set[str]:
    """What each object handed to a checkpointer is (as :func:`_kind` for state dicts)."""
    kinds = set()
    for key, value in entries:
        last = (dotted(value) or "").rsplit(".", 1)[-1].lower()
        k = (key or "").lower()
        if "scaler" in k or "scaler" in last or dotted(value) in model.scaler_keys:
            kinds.add("scaler")
        elif "optim" in k or "optim" in last:
            kinds.add("optimizer")
        elif k == "model" or is_model_like(model, value) or "model" in last:
            kinds.add("model")
        elif "sched" in k or "sched" in last or isinstance(value, ast.Constant):
            kinds.add("other")
        else:
            kinds.add("unknown")  # trainer=self: may save the scaler itself
    return kinds


def _short(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def _group(
    groups: dict[int, list[Any]],
    identity: int,
    call: ast.Call,
    entries: _Entries,
    kinds: set[str],
    via: Any,
) -> None:
    group = groups.get(identity)
    if group is None:
        groups[identity] = [call, entries, kinds, [call.lineno], via]
    elif call.lineno not in group[3]:
        group[3].append(call.lineno)
        group[3].sort()
        if call.lineno < group[0].lineno:
            group[0] = call


def _kinds(model: FileModel, entries: _Entries) -> set[str]:
    return {_kind(model, key, value) for key, value in entries}


def _entries(
    model: FileModel, obj: ast.AST | None, save: ast.Call, site_ids: set[int]
) -> tuple[_Entries, int] | None:
    """The (key, value) pairs of the dict being saved and the dict's identity (the node that
    builds it); ``None`` when they cannot all be known.

    A name is followed to the assignment that reaches the save (``ckpt = torch.load(...)`` at
    resume and ``ckpt = None`` earlier do not count), then to the entries added after it.
    """
    literal = _literal(obj)
    if literal is not None or not isinstance(obj, ast.Name):
        return None if literal is None or obj is None else (literal, id(obj))
    reach = reaching_assignment(model, obj.id, obj)
    if reach is None:
        return None
    literal = _literal(reach.value)
    if literal is None:
        return None
    start = reach.stmt.lineno
    scope = model.scope_of(obj)
    for target, value in model.subscript_sets:
        if (
            dotted(target.value) == obj.id
            and target.lineno > start
            and model.scope_of(target) is scope
        ):
            key = target.slice.value if isinstance(target.slice, ast.Constant) else None
            literal.append((key if isinstance(key, str) else None, value))
    for call in model.calls:
        if id(call) in site_ids or call.lineno <= start or model.scope_of(call) is not scope:
            continue  # another save of the same dict (best / last) adds nothing
        func = call.func
        if isinstance(func, ast.Attribute) and dotted(func.value) == obj.id:
            more = (
                _literal(call.args[0])
                if call.args
                else _literal(ast.Call(func=ast.Name("dict"), args=[], keywords=call.keywords))
            )
            if func.attr != "update" or more is None:
                return None
            literal.extend(more)
        elif any(dotted(a) == obj.id for a in (*call.args, *(k.value for k in call.keywords))):
            return None  # handed to a helper that may add entries
    return literal, id(reach.stmt)


def built_sites(ctx: Context) -> list[tuple[ast.Call, FileModel, Any, ast.AST, _Entries]]:
    """Calls to a saver of another file that builds the checkpoint dict itself from what it is
    passed (``save_checkpoint(model, optimizer, lr, it, path)``), with the dict's entries."""
    out = []
    for call, owner, helper, save, obj in builder_calls(ctx):
        found = _entries(owner, obj, save, {id(save)})
        if found is None:
            continue
        entries, _ = found
        node = obj if not isinstance(obj, ast.Name) else _dict_node(owner, obj)
        out.append((call, owner, helper, node if node is not None else save, entries))
    return out


def _dict_node(model: FileModel, name: ast.Name) -> ast.AST | None:
    reach = reaching_assignment(model, name.id, name)
    return reach.stmt if reach is not None else None


def _literal(node: ast.AST | None) -> _Entries | None:
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            return None
        return [
            (k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else None, v)
            for k, v in zip(node.keys, node.values, strict=True)
        ]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "dict"
        and not node.args
        and all(kw.arg is not None for kw in node.keywords)
    ):
        return [(kw.arg, kw.value) for kw in node.keywords]
    return None


def _kind(model: FileModel, key: str | None, value: ast.AST) -> str:
    """``scaler``/``model``/``optimizer``/``other``, or ``unknown`` for state we cannot see into.

    ``None`` (``"optimizer": None`` in a weights-only export) is no state at all; of
    ``x.state_dict() if keep else None`` the state counts.
    """
    if isinstance(value, ast.Constant) and value.value is None:
        return "other"
    if isinstance(value, ast.IfExp):
        for branch in (value.body, value.orelse):
            if not (isinstance(branch, ast.Constant) and branch.value is None):
                return _kind(model, key, branch)
        return "other"
    k = (key or "").lower()
    holder = _state_dict_holder(value)
    holder_text = (dotted(holder) or "").lower() if holder is not None else ""
    last = holder_text.rsplit(".", 1)[-1]
    if (
        "scaler" in k
        or k in ("amp", "scale", "loss_scale")
        or "scaler" in last
        or last == "amp"
        or (holder is not None and dotted(holder) in model.scaler_keys)
    ):
        return "scaler"
    if "optim" in k:
        return "optimizer"
    if "model" in k or k in ("state_dict", "net", "network", "weights", "params"):
        return "model"
    if holder is None:
        name = terminal(value.func) if isinstance(value, ast.Call) else None
        return "unknown" if name and "state" in name.lower() else "other"
    if "optim" in last or last in ("opt", "optimizer"):
        return "optimizer"
    if is_model_like(model, holder) or "model" in last or "ema" in last:
        return "model"
    if is_scheduler_like(model, holder):
        return "other"
    if _not_a_scaler(model, holder):
        return "other"
    return "unknown"


def _not_a_scaler(model: FileModel, holder: ast.AST) -> bool:
    """The file knows its scalers and ``holder`` is none of them: every value it was assigned
    is seen, and none is a scaler (``self.clip_grad_norm = instantiate_from_config(cfg)``)."""
    if not model.scaler_keys:
        return False
    values, complete = model.values_of(holder)
    if not values or not complete:
        return False
    for value in values:
        text = dotted(value) or ""
        called = (dotted(value.func) or "") if isinstance(value, ast.Call) else ""
        if text in model.scaler_keys or "scaler" in (text + called).lower():
            return False
        if isinstance(value, ast.Name):
            return False  # an alias of something else: may be the scaler
    return True


def _state_dict_holder(value: ast.AST) -> ast.AST | None:
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "state_dict"
    ):
        return value.func.value
    return None


def _check_load(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    for call in model.calls_to(_LOAD):
        flag = keyword(call, "weights_only")
        if flag is not None:
            if isinstance(flag, ast.Constant) and flag.value is False:
                yield ctx.finding(
                    AG208,
                    call,
                    "torch.load(..., weights_only=False) unpickles "
                    "arbitrary objects: loading an untrusted checkpoint runs its "
                    "code",
                    weights_only=False,
                )
            continue
        if any(kw.arg is None for kw in call.keywords) or ctx.torch_version is None:
            continue
        if ctx.torch_version < WEIGHTS_ONLY_DEFAULT_SINCE:
            version = ".".join(map(str, ctx.torch_version))
            yield ctx.finding(
                AG208,
                call,
                f"torch.load without weights_only: torch {version} "
                "defaults to weights_only=False and unpickles arbitrary objects",
                torch_version=version,
            )


AG205 = Rule.from_code(
    "AG205",
    fix="add 'scaler': scaler.state_dict() to the checkpoint and call "
    "scaler.load_state_dict(ckpt['scaler']) when resuming",
    triggers=("GradScaler", "unscale_", ".scale(", "caler"),
    check=_check_checkpoint,
)
AG208 = Rule.from_code(
    "AG208",
    fix="load with torch.load(path, weights_only=True) (register extra types with "
    "torch.serialization.add_safe_globals) or use ampguard.load_checkpoint",
    triggers=("weights_only", "torch.load", "import load", "serialization"),
    check=_check_load,
)
