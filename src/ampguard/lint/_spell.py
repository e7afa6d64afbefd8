"""The code's own spelling in messages and fixes: ``self.scaler.unscale_(self.optimizer)``, not a
generic ``scaler.unscale_(optimizer)``.

Rules that know the scaler's text (``self.scaler``) but not the optimizer it steps ask
:func:`stepped_optimizer`: the argument of the ``scaler.step(X)`` that follows the finding in
its function, else of the first one in the file. Text comes from :func:`ast.unparse` of the
node, which for the names, attributes and subscripts these are is the source as written.
"""

from __future__ import annotations

import ast
from typing import Any

from ampguard.lint._names import dotted

__all__ = ["source_text", "stepped_optimizer"]


def source_text(node: ast.AST) -> str:
    """The expression as code (``self.optimizer``, ``optimizers[0]``)."""
    return dotted(node) or ast.unparse(node)


def stepped_optimizer(model: Any, scaler: str | None, near: ast.AST) -> str | None:
    """Text of ``X`` in ``scaler.step(X)``: the first such call after ``near`` (by line) in the
    same function, else the first in the file; ``None`` when the file has none.

    ``model`` is the :class:`~ampguard.lint._model.FileModel` that holds ``near``.
    """
    if scaler is None:
        return None
    calls = [
        c
        for c in model.by_terminal.get("step", ())
        if isinstance(c.func, ast.Attribute)
        and dotted(c.func.value) == scaler
        and c.args
        and not isinstance(c.args[0], ast.Starred)
    ]
    if not calls:
        return None
    unit = model.function_of(near)
    line = getattr(near, "lineno", 0)
    after = [c for c in calls if model.function_of(c) is unit and c.lineno >= line]
    chosen = min(after or calls, key=lambda c: (c.lineno, c.col_offset))
    return source_text(chosen.args[0])
