"""Autocast coverage (public module): ``from ampguard.coverage import coverage, Coverage``.

The implementation is :mod:`ampguard._census`. Importing this submodule binds the name
``ampguard.coverage`` to the module, so the module itself is callable and forwards to
:func:`coverage`: ``ampguard.coverage(model, loss_fn, batch)`` works either way.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ampguard._census import FRAGILE_OPS, Coverage, coverage, coverage_from_events, is_heavy

__all__ = ["Coverage", "coverage", "coverage_from_events", "is_heavy", "FRAGILE_OPS"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Coverage:
        return coverage(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
