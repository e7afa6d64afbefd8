"""AG206: deprecated AMP entry points (``torch.cuda.amp.*``, ``torch.cpu.amp.*``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampguard.findings import Finding
from ampguard.lint._names import DEPRECATED
from ampguard.lint.rules._base import Context, Rule

__all__ = ["AG206"]

_DEPRECATED = frozenset(DEPRECATED)


def _check(ctx: Context) -> Iterator[Finding]:
    model = ctx.model
    for call in model.calls_to(_DEPRECATED):
        yield from _report(ctx, call, model.call_name(call))
    for funcs in model.functions.values():  # bare decorators: @torch.cuda.amp.custom_fwd
        for func in funcs:
            for deco in func.decorator_list:
                if isinstance(deco, (ast.Name, ast.Attribute)):
                    yield from _report(ctx, deco, model.qualname(deco))


def _report(ctx: Context, node: ast.AST, qual: str | None) -> Iterator[Finding]:
    if qual not in DEPRECATED:
        return
    new, device, spelling = DEPRECATED[qual]
    yield ctx.finding(
        AG206,
        node,
        f"{qual} is deprecated: use {spelling}",
        deprecated=qual,
        replacement=new,
        device=device,
    )


AG206 = Rule.from_code(
    "AG206",
    fix="replace torch.cuda.amp.X(...) with torch.amp.X('cuda', ...) and torch.cpu.amp.X(...) "
    "with torch.amp.X('cpu', ...) (for autocast: torch.amp.autocast(device_type=...))",
    triggers=("cuda.amp", "cpu.amp", "import amp"),
    check=_check,
)
