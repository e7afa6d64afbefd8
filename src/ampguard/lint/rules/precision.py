"""AG203 (GradScaler with bf16) and AG211 (model cast to fp16 while a GradScaler is used)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._context import (
    Autocast,
    autocast_info,
    bf16_precision,
    dtype_kind,
    is_eval_function,
    is_model_like,
    keyword,
    scaler_state,
)
from ampguard.lint._model import TopUnit
from ampguard.lint._names import AUTOCASTS, dotted
from ampguard.lint.rules._base import Context, Rule

__all__ = ["AG203", "AG211"]

# functions that halve a model for something other than training
_NOT_TRAINING = frozenset(
    {
        "export",
        "convert",
        "quantize",
        "deploy",
        "serve",
        "save",
        "benchmark",
        "generate",
        "sample",
        "inference",
        "trace",
        "script",
    }
)


def _bf16_sources(ctx: Context) -> list[tuple[ast.Call, Autocast | None]]:
    model = ctx.model
    out: list[tuple[ast.Call, Autocast | None]] = []
    for call in model.calls:
        if model.call_name(call) in AUTOCASTS or isinstance(model.parent(call), ast.withitem):
            info = autocast_info(model, call)  # with-items: also the project's autocast helpers
            if info is not None and info.dtype == "bf16" and info.enabled is not False:
                out.append((call, info))
        elif call.keywords and bf16_precision(model, call):
            out.append((call, None))
    return out


def _check_bf16(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    ctors = [(c, scaler_state(model, c)) for c in model.scaler_ctors]
    ctors = [(c, s) for c, s in ctors if s in ("on", "unknown")]
    if not ctors:
        return
    sources = _bf16_sources(ctx)
    for ctor, state in ctors:
        enabled = keyword(ctor, "enabled")
        for source, info in sources:
            if not _same_scope(ctx, ctor, source):
                continue
            if state == "unknown" and (
                info is None or enabled is None or info.enabled_text != ast.unparse(enabled)
            ):
                continue
            yield ctx.finding(
                AG203,
                ctor,
                f"GradScaler is enabled while autocast runs in bfloat16 (line "
                f"{source.lineno}): bf16 has fp32's range, so loss scaling only adds work and "
                "can skip steps for nothing",
                bf16_line=source.lineno,
            )
            break


def _same_scope(ctx: Context, ctor: ast.Call, source: ast.AST) -> bool:
    """Same module-level def/class (or both at module level), and the scaler exists whenever
    the bf16 region runs: its branch conditions are a prefix of the region's."""
    model = ctx.model
    unit, other = model.top_unit(ctor), model.top_unit(source)
    if unit is not other:
        return unit is model.tree and _mentions(ctx, other, _ctor_key(ctx, ctor))
    mine, theirs = model.branch_path(ctor), model.branch_path(source)
    return theirs[: len(mine)] == mine


def _ctor_key(ctx: Context, ctor: ast.Call) -> str | None:
    return next((k for k, c in ctx.model.ctor_targets.items() if c is ctor), None)


def _mentions(ctx: Context, unit: TopUnit, key: str | None) -> bool:
    """A module-level scaler is used inside ``unit`` (a module-level def or class)."""
    if key is None:
        return False
    return any(
        isinstance(n, (ast.Name, ast.Attribute)) and dotted(n) == key
        for n in ctx.model.statements(unit.body)
    )


def _fp16_cast(ctx: Context, call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "half":
        return not call.args and not call.keywords and not _cast_back(ctx, call)
    if func.attr in ("to", "type"):
        dtypes = [*call.args, *(kw.value for kw in call.keywords if kw.arg == "dtype")]
        return any(dtype_kind(ctx.model, d) == "fp16" for d in dtypes) and not _cast_back(ctx, call)
    return False


def _cast_back(ctx: Context, call: ast.Call) -> bool:
    """``model.half().float()``: the fp16 copy is cast straight back, so parameters stay fp32."""
    attr = ctx.model.parent(call)
    outer = ctx.model.parent(attr) if isinstance(attr, ast.Attribute) else None
    if not (isinstance(attr, ast.Attribute) and isinstance(outer, ast.Call) and outer.func is attr):
        return False
    if attr.attr == "float":
        return not outer.args and not outer.keywords
    if attr.attr == "to":
        dtypes = [*outer.args, *(kw.value for kw in outer.keywords if kw.arg == "dtype")]
        return any(
            ctx.model.qualname(d) == "torch.float32"
            for d in dtypes
            if isinstance(d, (ast.Name, ast.Attribute))
        )
    return False


def _scaler_users(ctx: Context) -> list[ast.AST]:
    """Enabled (non-sharded) GradScaler constructions and unmistakable uses of a scaler.

    ShardedGradScaler is left out: it is built to unscale fp16 gradients (pure fp16 + FSDP).
    """
    model = ctx.model
    users: list[ast.AST] = [
        c
        for c in model.scaler_ctors
        if scaler_state(model, c) != "off"
        and "Sharded" not in (model.call_name(c) or ast.unparse(c.func))
    ]
    sharded = {k for k, c in model.ctor_targets.items() if "Sharded" in ast.unparse(c.func)}
    for name in ("unscale_", "scale"):
        for call in model.by_terminal.get(name, ()):
            key = dotted(call.func.value) if isinstance(call.func, ast.Attribute) else None
            if key in model.scaler_keys and key not in sharded:
                users.append(call)
    return users


def _check_half(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    if not model.uses_grad_scaler:
        return
    users = _scaler_users(ctx)
    for name in ("half", "to", "type"):
        for call in model.by_terminal.get(name, ()):
            cast = call.func
            if (
                not isinstance(cast, ast.Attribute)
                or not _fp16_cast(ctx, call)
                or not is_model_like(model, cast.value)
            ):
                continue
            func = model.function_of(call)
            if is_eval_function(func) or (
                func is not None and _NOT_TRAINING & set(func.name.lower().split("_"))
            ):
                continue
            # a module-level cast halves the model for the whole script
            same = users if func is None else [u for u in users if model.function_of(u) is func]
            if not same or all(model.exclusive(call, u) for u in same):
                continue
            what = dotted(cast.value) or "the model"
            yield ctx.finding(
                AG211,
                call,
                f"{what} is cast to float16 while a GradScaler is used: fp16 "
                "master weights make scaler.unscale_ fail ('Attempting to unscale FP16 "
                "gradients') and small updates round away",
                model=what,
            )


AG203 = Rule.from_code(
    "AG203",
    fix="drop the GradScaler for bf16 (or build it with enabled=(dtype == torch.float16)); "
    "scaling is only needed for float16",
    triggers=("GradScaler", "caler"),
    check=_check_bf16,  # "caler": a project scaler factory
)
AG211 = Rule.from_code(
    "AG211",
    fix="keep the parameters in float32 and let autocast run the ops in fp16; remove "
    "model.half() / model.to(torch.float16)",
    triggers=("GradScaler", "unscale_", ".scale("),
    check=_check_half,
)
