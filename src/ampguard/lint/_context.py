"""Reading what a call means for precision: autocast regions, grad mode, dtypes, scaler switches."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TypeGuard

from ampguard.lint._calls import argument_for, keyword, resolve_def
from ampguard.lint._calls import constant as _constant
from ampguard.lint._model import FUNCS, FileModel
from ampguard.lint._names import AUTOCASTS, NO_GRAD, dotted, terminal
from ampguard.lint._scalers import scaler_state
from ampguard.lint._tree import walk

__all__ = [
    "Autocast",
    "autocast_info",
    "bf16_precision",
    "dtype_kind",
    "enclosing_autocast",
    "grad_disabled",
    "is_eval_function",
    "is_model_like",
    "is_scheduler_like",
    "keyword",
    "scaler_state",
]

# default autocast dtype per device type when none is given
_DEFAULT_DTYPE: dict[str | None, str] = {
    "cuda": "fp16",
    "cpu": "bf16",
    "xpu": "bf16",
    "mps": "fp16",
    "hpu": "bf16",
}
_EVAL_WORDS = frozenset(
    {
        "eval",
        "evaluate",
        "evaluation",
        "validate",
        "validation",
        "valid",
        "val",
        "predict",
        "prediction",
        "infer",
        "inference",
    }
)
_MODULE_WORDS = frozenset(
    {
        "model",
        "net",
        "network",
        "module",
        "encoder",
        "decoder",
        "backbone",
        "generator",
        "discriminator",
        "unet",
        "vae",
        "transformer",
        "classifier",
        "policy",
        "critic",
        "actor",
    }
)


@dataclass(frozen=True)
class Autocast:
    """An autocast region: dtype ``"fp16"``/``"bf16"``/``None`` (unknown), device, enabled flag."""

    call: ast.Call
    dtype: str | None
    device: str | None
    enabled: bool | None  # None: an expression we cannot evaluate
    enabled_text: str | None
    maybe: bool = False  # the context may also be something else (``nullcontext() if ... else``)


def dtype_kind(model: FileModel, expr: ast.AST | None, depth: int = 0) -> str | None:
    """``"fp16"``, ``"bf16"`` or ``None`` for a dtype expression (through single assignments)."""
    if expr is None or depth > 4:
        return None
    qual = model.qualname(expr) if isinstance(expr, (ast.Name, ast.Attribute)) else None
    if qual == "torch.float16":
        return "fp16"
    if qual == "torch.bfloat16":
        return "bf16"
    if isinstance(expr, (ast.Name, ast.Attribute)):
        value = model.single_value(expr)
        if value is not None and model.branch_path(value) == ():
            return dtype_kind(model, value, depth + 1)
    return None


def _partial_of(model: FileModel, func: ast.AST) -> ast.Call | None:
    if isinstance(func, ast.Name):
        value = model.single_value(func)
        if isinstance(value, ast.Call) and terminal(value.func) == "partial":
            return value
    return None


def autocast_info(model: FileModel, expr: ast.AST, depth: int = 0) -> Autocast | None:
    """The autocast region ``expr`` opens (a ``with`` item or a decorator), else ``None``."""
    if depth > 3:
        return None
    if isinstance(expr, (ast.Name, ast.Attribute)):  # ``ctx = torch.autocast(...)``; ``with ctx:``
        values, _ = model.values_of(expr)
        infos = [autocast_info(model, v, depth + 1) for v in values if isinstance(v, ast.Call)]
        found = [i for i in infos if i is not None]
        if not found:
            return None
        first = found[0]
        maybe = len(found) < len(values) or first.maybe
        return Autocast(
            first.call, first.dtype, first.device, first.enabled, first.enabled_text, maybe
        )
    if not isinstance(expr, ast.Call):
        return None
    qual = model.call_name(expr)
    if qual not in AUTOCASTS:
        func = expr.func
        if isinstance(func, ast.Attribute) and func.attr == "autocast" and qual is None:
            flag = keyword(expr, "enabled")  # accelerator.autocast(), self.autocast(enabled=...)
            value = _constant(flag) if flag is not None else None
            switch = value if isinstance(value, bool) else None
            text = ast.unparse(flag) if flag is not None else None
            return Autocast(expr, None, None, switch, text, maybe=True)
        return _helper_autocast(model, expr, depth)
    partial = _partial_of(model, expr.func)
    merged = ast.Call(
        func=expr.func,
        args=[*(partial.args[1:] if partial else []), *expr.args],
        keywords=[*(partial.keywords if partial else []), *expr.keywords],
    )
    if qual == "torch.amp.autocast":
        device_node = keyword(merged, "device_type", 0)
        device = _constant(device_node)
        device = device.split(":")[0] if isinstance(device, str) else None
        dtype_node, enabled_node = keyword(merged, "dtype", 1), keyword(merged, "enabled", 2)
    else:
        device = "cuda" if qual.startswith("torch.cuda") else "cpu"
        enabled_node, dtype_node = keyword(merged, "enabled", 0), keyword(merged, "dtype", 1)
    dtype = dtype_kind(model, dtype_node) if dtype_node is not None else _DEFAULT_DTYPE.get(device)
    enabled = _constant(enabled_node) if enabled_node is not None else True
    return Autocast(
        expr,
        dtype,
        device,
        enabled if isinstance(enabled, bool) else None,
        ast.unparse(enabled_node) if enabled_node is not None else None,
    )


def _helper_autocast(model: FileModel, call: ast.Call, depth: int) -> Autocast | None:
    """``with amp_context(args):`` where the project's own helper returns an autocast region
    (``return torch.autocast(...)``, or a ``@contextmanager`` that yields inside one)."""
    found = resolve_def(model, call.func)
    if found is None:
        return None
    owner, func = found
    if not isinstance(func, FUNCS):
        return None
    for node in owner.statements(func.body):
        if isinstance(node, ast.Return) and node.value is not None:
            info = autocast_info(owner, node.value, depth + 1)
        elif isinstance(node, (ast.With, ast.AsyncWith)) and any(
            isinstance(n, (ast.Yield, ast.YieldFrom)) for s in node.body for n in walk(s)
        ):
            info = next(
                (
                    i
                    for item in node.items
                    if (i := autocast_info(owner, item.context_expr, depth + 1))
                ),
                None,
            )
        else:
            continue
        if info is not None:
            return _bound(model, call, func, info)
    return None


def _bound(model: FileModel, call: ast.Call, func: ast.AST, info: Autocast) -> Autocast:
    """A helper's autocast seen from the caller: parameters replaced by the caller's arguments."""
    inner = info.call if isinstance(info.call, ast.Call) else None
    dtype, enabled, text = info.dtype, info.enabled, info.enabled_text
    if inner is not None:
        dtype_node = keyword(inner, "dtype")
        if dtype is None and isinstance(dtype_node, ast.Name):
            arg = argument_for(func, call, dtype_node.id)
            dtype = dtype_kind(model, arg) if arg is not None else None
        enabled_node = keyword(inner, "enabled")
        arg = None
        if isinstance(enabled_node, ast.Name):
            arg = argument_for(func, call, enabled_node.id)
        elif enabled_node is None and _forwards_kwargs(func, inner):
            arg = keyword(call, "enabled")  # def amp(**kw): return torch.autocast(..., **kw)
            if arg is None and any(kw.arg is None for kw in call.keywords):
                enabled = None  # amp(**cfg): the region may be switched off
                text = None
        if arg is not None:
            value = _constant(arg)
            enabled = value if isinstance(value, bool) else None
            text = ast.unparse(arg)
    return Autocast(call, dtype, info.device, enabled, text, info.maybe)


def _forwards_kwargs(func: ast.AST, inner: ast.Call) -> bool:
    """``inner`` passes on the helper's own ``**kwargs``."""
    kwarg = getattr(getattr(func, "args", None), "kwarg", None)
    return kwarg is not None and any(
        kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == kwarg.arg
        for kw in inner.keywords
    )


def enclosing_autocast(model: FileModel, node: ast.AST) -> Autocast | None:
    """The innermost autocast region around ``node`` in its function (``with`` or decorator)."""
    child = node
    for anc in model.ancestors(node):
        if isinstance(anc, (ast.With, ast.AsyncWith)) and child in anc.body:
            for item in reversed(anc.items):
                info = autocast_info(model, item.context_expr)
                if info is not None:
                    return info
        if isinstance(anc, FUNCS):
            for deco in anc.decorator_list:
                info = autocast_info(model, deco)
                if info is not None:
                    return info
            return None
        if isinstance(anc, (ast.Lambda, ast.ClassDef)):
            return None
        child = anc
    return None


def _disables_grad(model: FileModel, expr: ast.AST) -> bool:
    target = expr.func if isinstance(expr, ast.Call) else expr
    qual = model.qualname(target)
    if qual in NO_GRAD:
        return not (isinstance(expr, ast.Call) and _constant(keyword(expr, "mode", 0)) is False)
    if qual == "torch.set_grad_enabled" and isinstance(expr, ast.Call):
        return _constant(keyword(expr, "mode", 0)) is False
    return False


def grad_disabled(model: FileModel, node: ast.AST) -> bool:
    """``node`` runs under ``torch.no_grad()``/``inference_mode()`` (``with`` or decorator)."""
    child = node
    for anc in model.ancestors(node):
        if isinstance(anc, (ast.With, ast.AsyncWith)) and child in anc.body:
            if any(_disables_grad(model, item.context_expr) for item in anc.items):
                return True
        if isinstance(anc, FUNCS):
            return any(_disables_grad(model, deco) for deco in anc.decorator_list)
        if isinstance(anc, (ast.Lambda, ast.ClassDef)):
            return False
        child = anc
    return False


def is_eval_function(func: ast.AST | None) -> TypeGuard[ast.FunctionDef | ast.AsyncFunctionDef]:
    """A ``def`` whose name says it evaluates (``evaluate``, ``validate``, ``val_step``, ...)."""
    if not isinstance(func, FUNCS):
        return False
    words = [w for w in func.name.lower().split("_") if w]
    if not words:
        return False
    return words[0] in _EVAL_WORDS or func.name in ("test_step", "test_epoch", "test_loop")


def bf16_precision(model: FileModel, call: ast.Call) -> bool:
    """A framework switched to bf16 by keyword: ``precision="bf16-mixed"``, ``bf16=True``, ..."""
    for kw in call.keywords:
        if kw.arg in ("precision", "mixed_precision", "amp_dtype", "dtype"):
            value = _constant(kw.value)
            if isinstance(value, str) and ("bf16" in value or "bfloat16" in value):
                return True
        if kw.arg == "bf16" and _constant(kw.value) is True:
            return True
    return False


def _words(text: str) -> list[str]:
    return [w for w in text.lower().split("_") if w]


def is_model_like(model: FileModel, expr: ast.AST) -> bool:
    """``expr`` is very likely an ``nn.Module``: by its name or by the class it was built from."""
    while (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr in ("to", "cuda", "cpu", "train", "float", "half")
    ):
        expr = expr.func.value
    if isinstance(expr, ast.Call):
        return _is_module_ctor(expr)
    key = dotted(expr)
    if key is None:
        return False
    last = key.rsplit(".", 1)[-1]
    words = _words(last)
    if words and (words[-1] in _MODULE_WORDS or last.lower().endswith("model")):
        return True
    values, _ = model.values_of(expr)
    return any(isinstance(v, ast.Call) and _is_module_ctor(v) for v in values)


def _is_module_ctor(call: ast.Call) -> bool:
    name = terminal(call.func)
    if name == "from_pretrained" and isinstance(call.func, ast.Attribute):
        base = terminal(call.func.value) or ""
        return "Model" in base or base.endswith(("Net", "Network"))
    if not name or not name[0].isupper():
        return False
    return not name.endswith(("Tensor", "Dataset", "DataLoader", "Loader", "Tokenizer", "Config"))


def is_scheduler_like(model: FileModel, expr: ast.AST) -> bool:
    """``expr`` names an LR scheduler (by name or by the call that built it)."""
    key = dotted(expr)
    if key is None:
        return False
    if "sched" in key.rsplit(".", 1)[-1].lower():
        return True
    values, _ = model.values_of(expr)
    for value in values:
        if isinstance(value, ast.Call):
            qual = model.call_name(value) or ""
            name = terminal(value.func) or ""
            if qual.startswith("torch.optim.lr_scheduler.") or "schedul" in name.lower():
                return True
    return False
