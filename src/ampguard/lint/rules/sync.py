"""AG213: a host sync on every training step whose value is only logged.

Syncs: ``x.item()``, ``scaler.get_scale()``, ``.cpu()`` / ``.tolist()`` / ``.numpy()`` /
``float(t)`` of a device tensor, and a device tensor formatted as text (``f"{outputs.loss:.4f}"``,
``"%g" % loss``, ``str(loss)``, ``print(loss)``), for any expression that holds one (see
:mod:`._tensors`; tensors provably on the CPU do not count). Logged: printed, passed to a logger or
progress bar, fed to a running-average meter, or summed into a total that the step itself reads
only to log. Per step: in a loop that trains, in ``training_step``, or in a helper called from
one; also under ``if rank == 0:`` (every step on one rank) and under ``if step % k == 0`` with a
literal ``k`` below 10 (the message says how often). Test files (``test_*.py``, ``*_test.py``,
``conftest.py``) are not checked.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from ampguard.findings import Finding
from ampguard.lint._context import is_scheduler_like
from ampguard.lint._model import FUNCS, branch_of
from ampguard.lint._names import dotted, terminal
from ampguard.lint._reach import reaching_assignment
from ampguard.lint._tree import children, walk
from ampguard.lint.rules._base import Context, Rule
from ampguard.lint.rules._tensors import TensorFacts, host_syncs

__all__ = ["AG213"]

_LOG_METHODS = frozenset(
    {
        "info",
        "debug",
        "warning",
        "warn",
        "error",
        "critical",
        "exception",
        "log",
        "log_metric",
        "log_metrics",
        "add_scalar",
        "add_scalars",
        "set_postfix",
        "set_postfix_str",
        "set_description",
        "write",
        "put_scalar",
        "put_scalars",
        "log_dict",
    }
)
_METER_WORDS = ("meter", "metric", "smooth", "logger", "tracker", "averager", "running_avg")
_METER_CLASSES = ("Meter", "MetricLogger", "SmoothedValue", "Averager", "Tracker", "RunningAverage")
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_STOP = (*FUNCS, ast.Lambda, ast.ClassDef)
_MAX_PERIOD = 10  # under ``if step % k == 0`` a literal k below this still fires
_MAX_HELPER_DEPTH = 2  # helpers followed from the per-step call site
_RANK_WORDS = ("rank", "main_process", "master", "global_zero")


class _Step:
    """Where a sync runs per step: the description, the loop or function that repeats it, how
    often (``None``: every step), on which ranks, and the helper call it goes through."""

    __slots__ = ("where", "node", "period", "rank0", "via")

    def __init__(self, where: str, node: ast.AST) -> None:
        self.where = where
        self.node = node
        self.period: int | None = None
        self.rank0 = False
        self.via: list[str] = []


def _is_test_file(path: str) -> bool:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def _check(ctx: Context) -> Iterator[Finding]:
    if _is_test_file(ctx.path):
        return
    model = ctx.model
    facts = TensorFacts(model)
    for node, what in _syncs(ctx, facts):
        found = _per_step(ctx, node, 0)
        if found is None:
            continue
        home = model.function_of(node) if found.via else None
        uses = _only_logged(ctx, node, home if home is not None else found.node)
        if uses is None:
            continue
        throttle = _throttle(ctx, uses) if uses else None
        what = _sync_name(node, what)
        how = (
            "on every training step"
            if found.period is None
            else (f"every {found.period} training steps")
        )
        if found.rank0:
            how += " on the main rank"
        where = found.where + "".join(found.via)
        logged = f" only to be logged under 'if {throttle}'" if throttle else " only to be logged"
        yield ctx.finding(
            AG213,
            node,
            f"{what} runs {how} ({where}){logged}: "
            "each call waits for the device (a host sync); log every N steps or accumulate on "
            "the device",
            sync=what,
            unit=unit.name if (unit := model.function_of(node)) is not None else "<module>",
            period=found.period or 1,
        )


def _sync_name(node: ast.AST, what: str) -> str:
    """The sync as the message names it: whole when short, else by the tensor it reads
    (``loss.item()`` for ``self.criterion(out, y)["loss"].mean().item()`` reads ``mean()`` of
    ``loss``: it is written ``loss (...).item()``), never a cut-off fragment."""
    if len(what) <= 40:
        return what
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        tensor = _tensor_name(node.func.value)
        if tensor is not None:
            return f"{tensor}.{node.func.attr}()"
    tensor = _tensor_name(node)
    return f"a sync of {tensor}" if tensor is not None else what[:37] + "..."


def _tensor_name(expr: ast.AST) -> str | None:
    """The innermost name an expression reads its tensor from: ``outputs["loss"]`` -> ``loss``,
    ``self.model(x).loss.mean()`` -> ``loss``, ``loss_dict[k]`` -> ``loss_dict``."""
    node = expr
    while True:
        if isinstance(node, ast.Call):
            node = node.func.value if isinstance(node.func, ast.Attribute) else node.func
        elif isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                return key.value
            node = node.value
        elif isinstance(node, ast.Attribute):
            if len(ast.unparse(node)) <= 30:
                return ast.unparse(node)
            return node.attr
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def _syncs(ctx: Context, facts: TensorFacts) -> Iterator[tuple[ast.AST, str]]:
    """Host syncs: ``x.item()``, ``.cpu()``/``.tolist()``/``.numpy()``/``float()`` of a device
    tensor, ``scaler.get_scale()``, and a device tensor formatted as text."""
    model = ctx.model
    for call in model.by_terminal.get("get_scale", ()):
        if isinstance(call.func, ast.Attribute) and dotted(call.func.value) in model.scaler_keys:
            yield call, ast.unparse(call)
    yield from host_syncs(model, facts)


def _condition(test: ast.AST, model: Any = None) -> tuple[bool, int | None] | None:
    """``(rank 0 only, period)`` for the body of ``if test:`` when it still runs per step
    (``rank == 0``, ``step % 5 == 0``), ``None`` when it is a throttle or unknown."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        rank0, period = False, None
        for value in test.values:
            part = _condition(value, model)
            if part is None:
                return None
            rank0 = rank0 or part[0]
            period = _times(period, part[1])
        return rank0, period
    mod = None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        mod = test.operand
    elif (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == 0
    ):
        mod = test.left
    if isinstance(mod, ast.BinOp) and isinstance(mod.op, ast.Mod):
        k = mod.right.value if isinstance(mod.right, ast.Constant) else None
        if isinstance(k, int) and not isinstance(k, bool) and 0 < k < _MAX_PERIOD:
            return False, k
        return None  # every N steps (N from the config, or >= 10): the recommended throttle
    words = [
        n.id if isinstance(n, ast.Name) else n.attr
        for n in walk(test)
        if isinstance(n, (ast.Name, ast.Attribute))
    ]
    if any(w in word.lower() for word in words for w in _RANK_WORDS):
        return True, None
    if _is_config(test, model):
        return False, None  # if cfg.DETECTION.ENABLE: the same branch every step
    return None


# roots of a run's configuration: a test that reads only these picks one branch for the whole run
_CONFIG_ROOTS = frozenset(
    {"cfg", "config", "conf", "args", "opt", "opts", "hparams", "hp", "flags", "settings"}
)


def _is_config(test: ast.AST, model: Any = None) -> bool:
    """``test`` reads only the run's configuration (``cfg.DETECTION.ENABLE``,
    ``not self.args.use_ema``, ``args.model == "vit"``) or a flag the object sets once
    (``self.log_grad_scaler``, assigned in ``__init__`` only): it does not throttle, each branch
    runs on every step of a run that takes it."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _is_config(test.operand, model)
    if isinstance(test, ast.BoolOp):
        return all(_is_config(v, model) for v in test.values)
    if isinstance(test, ast.Compare):
        return _is_config(test.left, model) and all(
            isinstance(c, ast.Constant) or _is_config(c, model) for c in test.comparators
        )
    if not isinstance(test, ast.Attribute):
        return False
    parts = (dotted(test) or "").split(".")
    if parts[0] == "self":
        if len(parts) == 2 and model is not None and _set_once(model, test):
            return True
        parts = parts[1:]
    return len(parts) > 1 and parts[0].lower() in _CONFIG_ROOTS


def _set_once(model: Any, attr: ast.Attribute) -> bool:
    """``self.flag`` is assigned in its class's ``__init__`` and nowhere else in the class."""
    cls = model.class_of(attr)
    if cls is None:
        return False
    key, seen = dotted(attr), False
    for method in cls.body:
        if not isinstance(method, FUNCS):
            continue
        for node in model.statements(method.body):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if dotted(node) == key:
                    if method.name != "__init__":
                        return False
                    seen = True
    return seen


def _times(a: int | None, b: int | None) -> int | None:
    """Two periods nested: every ``a`` steps, of those every ``b`` (``None``: every step)."""
    if a is None:
        return b
    return a if b is None else a * b


def _per_step(ctx: Context, node: ast.AST, depth: int) -> _Step | None:
    """Where ``node`` runs once per step (``loop at line N`` / ``training_step`` / a helper called
    from there), else ``None``."""
    child: ast.AST = node
    rank0, period = False, None
    for anc in ctx.model.ancestors(node):
        if branch_of(anc, child) is not None:
            part = None
            if isinstance(anc, ast.If) and any(s is child for s in anc.body):
                part = _condition(anc.test, ctx.model)
            elif isinstance(anc, ast.If) and _is_config(anc.test, ctx.model):
                part = (False, None)  # the else of a config test: as much per step
            if part is None:
                return None  # conditional: already throttled (or at least not every step)
            rank0 = rank0 or part[0]
            period = _times(period, part[1])
            child = anc
            continue
        found: _Step | None = None
        if isinstance(anc, _LOOPS):
            if not any(s is child for s in anc.body):
                return None
            if not _trains(ctx, anc.body, 0):  # for k, v in loss_dict.items(): per step, n times
                child = anc
                continue
            found = _Step(f"loop at line {anc.lineno}", anc)
        elif isinstance(anc, _STOP):
            if isinstance(anc, FUNCS) and (
                anc.name == "training_step"
                or (anc.name.endswith("_step") and _trains(ctx, anc.body, 0))
            ):  # run_step / train_step: the framework's loop calls it once per step
                found = _Step(f"{anc.name}", anc)
            elif isinstance(anc, FUNCS) and depth < _MAX_HELPER_DEPTH:
                found = _called_per_step(ctx, anc, depth)
            if found is None:
                return None
        if found is not None:
            found.rank0 = found.rank0 or rank0
            found.period = _times(found.period, period)
            return found
        if isinstance(anc, ast.withitem) or (
            isinstance(anc, (ast.If, ast.While)) and child is anc.test
        ):
            return None
        child = anc
    return None


def _called_per_step(
    ctx: Context, func: ast.FunctionDef | ast.AsyncFunctionDef, depth: int
) -> _Step | None:
    """A helper (``self.log_step(loss)``, ``log_metrics(loss)``) called once per step."""
    model = ctx.model
    cls = model.class_of(func)
    method = cls is not None and model.parent(func) is cls
    for call in model.by_terminal.get(func.name, ()):
        target = call.func
        if method:
            if not (isinstance(target, ast.Attribute) and dotted(target.value) == "self"):
                continue
            if model.class_of(call) is not cls:
                continue
        elif not isinstance(target, ast.Name):
            continue
        else:
            found = model.binding(target.id, model.scope_of(call))
            if not (found and found[0] == "values" and func in found[1]):
                continue
        step = _per_step(ctx, call, depth + 1)
        if step is not None:
            step.via.insert(0, f", in {func.name}() called at line {call.lineno}")
            return step
    return None


def _trains(ctx: Context, body: list[ast.stmt], depth: int) -> bool:
    """``body`` (not its nested loops) runs backward() or an optimizer/scaler step."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (*_STOP, *_LOOPS)):  # a helper that loops is an epoch, not a step
            continue
        if isinstance(node, ast.Call) and _training_call(ctx, node, depth):
            return True
        stack.extend(children(node))
    return False


def _training_call(ctx: Context, call: ast.Call, depth: int) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        if func.attr == "backward":
            return True
        if (
            func.attr == "step"
            and dotted(func.value) is not None
            and not is_scheduler_like(ctx.model, func.value)
        ):
            return True
    if depth >= 2:
        return False
    if isinstance(func, ast.Attribute) and dotted(func.value) == "self":  # self.train_step(b)
        cls = ctx.model.class_of(call)
        for stmt in cls.body if cls is not None else ():
            if isinstance(stmt, FUNCS) and stmt.name == func.attr:
                return _trains(ctx, stmt.body, depth + 1)
        return False
    if not isinstance(func, ast.Name):
        return False
    found = ctx.model.binding(func.id, ctx.model.scope_of(call))
    if found and found[0] == "values" and len(found[1]) == 1 and isinstance(found[1][0], FUNCS):
        return _trains(ctx, found[1][0].body, depth + 1)
    return False


def _is_log_call(ctx: Context, node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "print"
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "update" or func.attr.startswith(_METER_METHODS):
        if not (node.args or node.keywords):
            return False
        # a number handed to .update() makes a meter (a dict or set cannot take one)
        return _is_meter(ctx, func.value) or any(_is_number(ctx, a) for a in node.args)
    return func.attr in _LOG_METHODS


_METER_METHODS = ("update_stats", "update_metrics", "update_meters", "update_loss")
_NUMBER_CALLS = frozenset({"item", "float"})


def _is_number(ctx: Context, arg: ast.AST) -> bool:
    """``arg`` is a Python number read from a tensor: ``loss.item()``, ``float(loss)``, or a
    name assigned one."""
    if isinstance(arg, ast.Name):
        values, complete = ctx.model.values_of(arg)
        return complete and len(values) == 1 and _is_number(ctx, values[0])
    return isinstance(arg, ast.Call) and terminal(arg.func) in _NUMBER_CALLS


def _is_meter(ctx: Context, recv: ast.AST) -> bool:
    """A running-average sink: MetricLogger, SmoothedValue, AverageMeter and the like."""
    if isinstance(recv, ast.Subscript):  # meters["loss"].update(...)
        recv = recv.value
    key = dotted(recv)
    if key is None:
        return False
    last = key.rsplit(".", 1)[-1].lower()
    if any(word in last for word in _METER_WORDS):
        return True
    values, _ = ctx.model.values_of(recv)
    return any(
        isinstance(v, ast.Call) and (terminal(v.func) or "").endswith(_METER_CLASSES)
        for v in values
    )


def _only_logged(ctx: Context, node: ast.AST, where: ast.AST) -> list[ast.AST] | None:
    """The value goes straight into a logging call, into a name used only by logging calls, or
    into a running total (``epoch_loss += loss.item()``) that the step reads only to log it.

    Returns the reads that log it (empty when the sync sits in the logging call itself), or
    ``None`` when the value is used otherwise.
    """
    model = ctx.model
    child: ast.AST = node
    anc: ast.AST = node
    for anc in model.ancestors(node):
        if isinstance(anc, ast.Call) and _is_log_call(ctx, anc) and child is not anc.func:
            return []
        if isinstance(anc, ast.stmt):
            break
        child = anc
    stmt = anc
    if isinstance(stmt, ast.AugAssign) and child is stmt.value:
        key = dotted(stmt.target)
        body = where.body if isinstance(where, (*_LOOPS, *FUNCS)) else [where]
        uses: list[ast.AST] = [
            n
            for n in model.statements(body)
            if n is not stmt.target
            and isinstance(n, (ast.Name, ast.Attribute))
            and isinstance(n.ctx, ast.Load)
            and dotted(n) == key
        ]
        if key is not None and "." in key and not uses and isinstance(where, FUNCS):
            return None  # self.state.tokens_seen += ...: read outside this function
        return uses if key is not None and all(_inside_log(ctx, n) for n in uses) else None
    if (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Attribute)
        and stmt.targets[0].attr in ("desc", "postfix")
    ):
        return []  # pbar.desc = f"loss {loss.item():.3f}"
    if (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Attribute)
        and _is_meter(ctx, stmt.targets[0].value)
    ):
        return []  # tracker.loss = loss.item(): a metrics object's field, read to log it
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
    ):
        return None
    name = stmt.targets[0].id
    unit = model.function_of(node)
    body = unit.body if unit is not None else model.tree.body
    named: list[ast.AST] = [
        n
        for n in model.statements(body)
        if isinstance(n, ast.Name)
        and n.id == name
        and isinstance(n.ctx, ast.Load)
        and _may_read(model, name, n, stmt)
    ]
    return named if named and all(_inside_log(ctx, n) for n in named) else None


def _may_read(model: Any, name: str, use: ast.AST, stmt: ast.stmt) -> bool:
    """``use`` may read what ``stmt`` assigned: not when another assignment reaches it
    (``loss = model(x)`` before ``scaler.scale(loss)``, then ``loss = loss.item()``)."""
    if any(a is stmt for a in model.ancestors(use)):
        return False  # loss = loss.item(): read before the assignment
    reach = reaching_assignment(model, name, use)
    return reach is None or reach.stmt is stmt


def _throttle(ctx: Context, uses: list[ast.AST]) -> str | None:
    """The ``if step % N == 0`` test every logging read sits under, if they share one."""
    tests = set()
    for use in uses:
        test = None
        for anc in ctx.model.ancestors(use):
            if isinstance(anc, ast.If) and any(
                isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in walk(anc.test)
            ):
                test = ast.unparse(anc.test)
                break
            if isinstance(anc, _STOP):
                break
        if test is None:
            return None
        tests.add(test)
    return tests.pop() if len(tests) == 1 else None


def _inside_log(ctx: Context, node: ast.AST) -> bool:
    child = node
    for anc in ctx.model.ancestors(node):
        if isinstance(anc, ast.Call) and _is_log_call(ctx, anc) and child is not anc.func:
            return True
        if isinstance(anc, ast.stmt):
            return False
        child = anc
    return False


AG213 = Rule.from_code(
    "AG213",
    fix="log every N steps (if step % N == 0: print(loss.item())), or accumulate on the device "
    "(running += loss.detach()) and read it once per N steps",
    triggers=(".item()", "get_scale", ".backward("),
    check=_check,
)
