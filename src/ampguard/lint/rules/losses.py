"""AG209 (``log(softmax(x))``) and AG210 (``binary_cross_entropy``/``BCELoss`` under autocast)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._context import enclosing_autocast
from ampguard.lint._names import BCE_FUNCTIONS, BCE_MODULES, SOFTMAXES
from ampguard.lint.rules._base import Context, Rule

__all__ = ["AG209", "AG210"]


def _squash(ctx: Context, node: ast.AST, depth: int = 0) -> str | None:
    """``"softmax"`` when ``node`` is (an index of, or a name bound to) a softmax."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name) and depth == 0:
        value = ctx.model.single_value(node)
        return _squash(ctx, value, depth + 1) if value is not None else None
    if not isinstance(node, ast.Call):
        return None
    qual = ctx.model.call_name(node)
    if qual in SOFTMAXES:
        return "softmax"
    func = node.func
    if isinstance(func, ast.Call) and ctx.model.call_name(func) == "torch.nn.Softmax":
        return "softmax"  # nn.Softmax(dim=1)(x)
    if isinstance(func, ast.Attribute) and func.attr == "softmax" and qual is None:
        return "softmax"  # tensor method: x.softmax(-1)
    return None


def _check_log(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    for name in ("log", "log_"):
        for call in model.by_terminal.get(name, ()):
            func = call.func
            if model.call_name(call) == "torch.log" and call.args:
                inner = _squash(ctx, call.args[0])
            elif isinstance(func, ast.Attribute) and not call.args and model.qualname(func) is None:
                inner = _squash(ctx, func.value)
            else:
                continue
            if inner is not None:
                yield ctx.finding(
                    AG209,
                    call,
                    "log of softmax: the probabilities underflow to 0 (log -> -inf) "
                    "for confident predictions, worse in fp16; use log_softmax (or cross_entropy "
                    "on the logits)",
                    op=inner,
                )


def _is_bce(ctx: Context, call: ast.Call) -> str | None:
    model = ctx.model
    qual = model.call_name(call)
    if qual in BCE_FUNCTIONS:
        return "binary_cross_entropy"
    func = call.func
    if isinstance(func, ast.Call) and model.call_name(func) in BCE_MODULES:
        return "BCELoss"
    if isinstance(func, (ast.Name, ast.Attribute)) and qual is None:
        values, _ = model.values_of(func)
        if any(isinstance(v, ast.Call) and model.call_name(v) in BCE_MODULES for v in values):
            return "BCELoss"
    return None


def _check_bce(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    for call in model.calls:
        what = _is_bce(ctx, call)
        if what is None:
            continue
        region = enclosing_autocast(model, call)
        if region is None or region.enabled is False or region.device == "cpu":
            continue
        yield ctx.finding(
            AG210,
            call,
            f"{what} inside autocast: it is unsafe in float16 and autocast raises "
            "an error for it on CUDA; use binary_cross_entropy_with_logits / BCEWithLogitsLoss "
            "on the logits",
            loss=what,
            autocast_line=region.call.lineno,
        )


AG209 = Rule.from_code(
    "AG209",
    fix="use torch.log_softmax(x, dim), or F.cross_entropy / F.nll_loss(F.log_softmax(x)) for a "
    "loss, instead of taking the log of softmax probabilities",
    triggers=("softmax",),
    check=_check_log,
)
AG210 = Rule.from_code(
    "AG210",
    fix="feed the logits to F.binary_cross_entropy_with_logits or nn.BCEWithLogitsLoss (they are "
    "autocast-safe), instead of sigmoid + BCE",
    triggers=("binary_cross_entropy", "BCELoss"),
    check=_check_bce,
)
