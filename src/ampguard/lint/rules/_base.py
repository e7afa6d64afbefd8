"""What a rule is, and the per-file context every rule's check receives."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ampguard.findings import Finding
from ampguard.findings.codes import lookup
from ampguard.lint._model import FileModel

__all__ = ["Context", "Rule"]


@dataclass
class Context:
    """One file being checked: its model, its path and the options of the run."""

    model: FileModel
    path: str
    torch_version: tuple[int, int] | None = None
    cache: dict[str, Any] = field(default_factory=dict)

    def finding(
        self, rule: Rule, node: ast.AST, message: str, *, fix: str | None = None, **evidence: Any
    ) -> Finding:
        """A :class:`Finding` of ``rule`` located at ``node``; ``fix``: the rule's advice
        written with the code's own names (default: the rule's generic advice)."""
        line = getattr(node, "lineno", 1)
        evidence["end_line"] = getattr(node, "end_lineno", line) or line
        return Finding(
            code=rule.code,
            severity=rule.severity,
            title=rule.title,
            message=message,
            evidence=evidence,
            fix=rule.fix if fix is None else fix,
            path=self.path,
            line=line,
            col=getattr(node, "col_offset", 0) + 1,
        )


@dataclass(frozen=True)
class Rule:
    """A lint rule: stable code, what it catches, the fix, and its check.

    ``triggers`` are substrings of the source; a file that contains none of them cannot fire the
    rule, so the rule is not run on it (this keeps the linter fast on large trees). A file must
    also contain one of ``requires``, when given. :meth:`from_code` takes the severity and the
    title from the catalogue of finding codes (every rule is declared that way).
    """

    code: str
    severity: str
    title: str
    fix: str
    triggers: tuple[str, ...]
    check: Callable[[Context], Iterable[Finding]] | None = None
    requires: tuple[str, ...] = ()

    @classmethod
    def from_code(
        cls,
        code: str,
        *,
        triggers: tuple[str, ...],
        check: Callable[[Context], Iterable[Finding]] | None = None,
        requires: tuple[str, ...] = (),
        fix: str | None = None,
    ) -> Rule:
        """The rule of catalogued ``code``: severity and title from the catalogue; ``fix``
        (the longer advice lint prints) defaults to the catalogue's."""
        entry = lookup(code)
        return cls(
            code=code,
            severity=entry.severity,
            title=entry.title,
            fix=entry.fix if fix is None else fix,
            triggers=triggers,
            check=check,
            requires=requires,
        )
