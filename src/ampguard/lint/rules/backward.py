"""AG214: a backward pass inside an ``autocast`` region (the AMP recipe advises against it).

Fires on ``x.backward()``, ``scaler.scale(loss).backward()``, ``accelerator.backward(loss)``,
``torch.autograd.backward`` and ``torch.autograd.grad`` without ``create_graph``. Silent on
``torch.autograd.grad(..., create_graph=True)``: that is the forward pass of a gradient penalty
(its graph becomes part of the loss), and PyTorch's AMP gradient-penalty example builds the penalty
from those gradients under autocast; the penalty's own backward comes after the block.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._context import enclosing_autocast, keyword
from ampguard.lint.rules._base import Context, Rule

__all__ = ["AG214"]

_BACKWARD = frozenset({"torch.autograd.backward"})
_GRAD = frozenset({"torch.autograd.grad"})


def _backward_calls(ctx: Context) -> Iterator[tuple[ast.Call, str]]:
    model = ctx.model
    for call in model.by_terminal.get("backward", ()):
        func = call.func
        if isinstance(func, ast.Attribute):
            qual = model.call_name(call)
            if qual is None or qual in _BACKWARD:  # x.backward(), accelerator.backward(loss)
                yield call, ast.unparse(func)[-60:] + "()"
    for call in model.by_terminal.get("grad", ()):
        if model.call_name(call) in _GRAD and not _creates_graph(call):
            yield call, "torch.autograd.grad()"


def _creates_graph(call: ast.Call) -> bool:
    """``autograd.grad(..., create_graph=True)``: a penalty whose graph continues in the region."""
    node = keyword(call, "create_graph", 4)
    return node is not None and not (isinstance(node, ast.Constant) and node.value is False)


def _check(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    for call, what in _backward_calls(ctx):
        region = enclosing_autocast(model, call)
        if region is None or region.enabled is False:
            continue
        line = getattr(region.call, "lineno", 0)
        yield ctx.finding(
            AG214,
            call,
            f"{what} runs inside the autocast region opened at line {line}: run "
            "only the forward pass and the loss under autocast and call backward after the with "
            "block",
            autocast_line=line,
        )


AG214 = Rule.from_code(
    "AG214",
    fix="dedent the backward call (scaler.scale(loss).backward()) out of the "
    "'with torch.autocast(...)' block; backward ops already run in the dtype autocast chose "
    "for their forward ops",
    # a region: torch's autocast, or (project mode) a helper such as amp_ctx() / maybe_amp()
    triggers=("autocast", "amp_", "_amp"),
    requires=(".backward(", "autograd.grad"),
    check=_check,
)
