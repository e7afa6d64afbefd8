"""Precision names for tests, chosen by their registry facts (never a hand-written list).

A test that runs "every precision without a conversion" or "every precision without a loss
scale" asks here, so a new registry entry is in it without an edit.
"""

from __future__ import annotations

from ampguard import precisions
from ampguard.precisions import REGISTRY

__all__ = ["block_scaled", "plain", "untraced"]


def plain(*, scaled: bool | None = None) -> list[str]:
    """The registered precisions without a conversion hook (autocast alone, or autocast off), in
    registry order; with ``scaled`` only those with (True) or without (False) a loss scale."""
    return [
        n
        for n, p in REGISTRY.items()
        if p.hook is None and (scaled is None or p.needs_scaler == scaled)
    ]


def block_scaled() -> list[str]:
    """The precisions trained by block-scaled emulation (hooks of ``ampguard.fp8._block``)."""
    return [n for n, p in REGISTRY.items() if (p.hook or "").startswith("ampguard.fp8._block:")]


def untraced() -> list[str]:
    """The registered precisions that ``ag.locate`` / ``ag.coverage`` refuse (not autocast
    alone: full precision, or one that converts the model)."""
    return [n for n in precisions.names() if n not in precisions.traced()]
