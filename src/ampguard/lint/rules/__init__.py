"""The lint rules, by code. Each module holds one rule or a small group of related rules."""

from __future__ import annotations

from ampguard.lint.rules._base import Context, Rule
from ampguard.lint.rules.backward import AG214
from ampguard.lint.rules.checkpoint import AG205, AG208
from ampguard.lint.rules.deprecated import AG206
from ampguard.lint.rules.grad_mode import AG212
from ampguard.lint.rules.losses import AG209, AG210
from ampguard.lint.rules.order import AG201, AG202
from ampguard.lint.rules.precision import AG203, AG211
from ampguard.lint.rules.scheduler import AG207
from ampguard.lint.rules.sync import AG213
from ampguard.lint.rules.update import AG204

__all__ = ["RULES", "Context", "Rule"]

AG200 = Rule.from_code(
    "AG200",
    fix="fix the syntax error or save the file as UTF-8 (or declare its encoding)",
    triggers=(),
)

RULES: dict[str, Rule] = {
    rule.code: rule
    for rule in (
        AG200,
        AG201,
        AG202,
        AG203,
        AG204,
        AG205,
        AG206,
        AG207,
        AG208,
        AG209,
        AG210,
        AG211,
        AG212,
        AG213,
        AG214,
    )
}
