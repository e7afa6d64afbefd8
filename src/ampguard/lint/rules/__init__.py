"""The lint rules, by code. Each public module holds one rule or a small group of related
rules; :data:`RULES` is found by discovery (:mod:`._registry`): a new rule module needs no entry
here."""

from __future__ import annotations

from ampguard.lint.rules._base import Context, Rule
from ampguard.lint.rules._registry import RULES

__all__ = ["RULES", "Context", "Rule"]
