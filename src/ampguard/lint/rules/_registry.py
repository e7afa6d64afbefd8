"""The lint rules, found rather than listed: every public module of this package is a rule module.

A rule module (``backward.py``, ``losses.py``, ...) declares one rule or a small group with
:meth:`Rule.from_code` and names them in its ``__all__``; :func:`discover` imports each such
module (the ones whose names do not start with ``_``) and collects the rules by code. Adding a
rule is its module (or a line in a related one) and its catalogue entry: no import list or
tuple of rules to extend. Imports no torch; costs one directory listing and the imports.
"""

from __future__ import annotations

import importlib
import pkgutil

from ampguard.lint.rules._base import Rule

__all__ = ["RULES", "discover"]


def discover(package: str = __package__ or "ampguard.lint.rules") -> dict[str, Rule]:
    """Every rule of the public modules of ``package`` (this one by default), by code, in code
    order: the :class:`Rule` objects each module names in its ``__all__``.

    A code declared by two modules is a ``RuntimeError`` naming both.
    """
    here = importlib.import_module(package)
    found: dict[str, Rule] = {}
    where: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(here.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        for name in getattr(module, "__all__", ()):
            rule = getattr(module, name)
            if not isinstance(rule, Rule):
                continue
            if rule.code in found:
                raise RuntimeError(
                    f"lint rule {rule.code} is declared twice: in {where[rule.code]} and "
                    f"{module.__name__}"
                )
            found[rule.code] = rule
            where[rule.code] = module.__name__
    return dict(sorted(found.items()))


RULES: dict[str, Rule] = discover()
"""Every lint rule by code (``AG200``, ``AG201``, ...), in code order."""
