"""AG200: a file lint could not read (syntax, encoding, not a regular file, too large).

The engine reports it (the rule has no check of its own): for a file that does not parse or
cannot be read, and as an info note for a function over the order rules' path budget.
"""

from __future__ import annotations

from ampguard.lint.rules._base import Rule

__all__ = ["AG200"]

AG200 = Rule.from_code(
    "AG200",
    fix="fix the syntax error or save the file as UTF-8 (or declare its encoding)",
    triggers=(),
)
