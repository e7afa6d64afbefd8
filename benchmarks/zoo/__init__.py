"""The silent-failure zoo: one case per module in this folder, run by ``benchmarks/silent_zoo.py``.

A *silent* precision failure is one where nothing non-finite reaches the loss or the gradients,
so a bare ``GradScaler`` never notices. Each case module (any ``*.py`` here not starting with
``_``) exposes:

``NAME``
    a short, unique identifier (``"absorbed_norm"``);
``DESCRIPTION``
    one line: the mechanism, in the words a user would search for;
``build() -> Case``
    a fresh, seeded instance (see :class:`Case`): small (width <= 64) so it runs on a CPU in
    seconds;
``EXPECT``
    a dict of what ampguard must say, any of the keys ``"locate"`` (the expected
    ``Diagnosis.kind``), ``"guard"`` (a finding code the Guard run must produce),
    ``"advisor"`` (a finding code ``ag.inspect_model`` must produce) and ``"module"`` (the
    module those name); a key left out is not checked.

Discovery (:func:`discover`) imports every such module and checks the interface, so a broken
case fails loudly instead of vanishing from the zoo.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["Case", "EXPECT_KEYS", "discover", "load"]

EXPECT_KEYS = frozenset({"locate", "guard", "advisor", "module"})


@dataclass
class Case:
    """One built instance of a zoo case.

    ``loss_fn(model, batch) -> loss`` is the ``ag.locate`` / ``ag.inspect_model`` signature;
    ``batches`` the training batches the Guard run iterates (a list, reused in order);
    ``guard_kwargs`` extra ``ag.Guard`` arguments (``precision`` defaults to ``"fp16"``;
    ``telemetry`` is set by the runner); ``locate_kwargs`` extra ``ag.locate`` arguments (e.g.
    ``{"scale": 1.0}`` for a loop without a loss scaler); ``steps`` how many Guard steps to run;
    ``loop`` how the runner trains it: ``"guard"`` (``ag.Guard(model, optimizer,
    **guard_kwargs)``) or ``"watch"`` (a plain autocast loop with no loss scaler, observed with
    ``ag.watch(None, model, optimizer, telemetry, precision=guard_kwargs["precision"])``).
    """

    model: Any
    optimizer: Any
    batches: list[Any]
    loss_fn: Callable[[Any, Any], Any]
    guard_kwargs: dict[str, Any] = field(default_factory=dict)
    locate_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 20
    loop: str = "guard"

    def __post_init__(self) -> None:
        if self.loop not in ("guard", "watch"):
            raise ValueError(f"Case.loop must be 'guard' or 'watch', got {self.loop!r}")


def _check(module: ModuleType) -> ModuleType:
    for attr in ("NAME", "DESCRIPTION", "build", "EXPECT"):
        if not hasattr(module, attr):
            raise TypeError(f"zoo case {module.__name__} has no {attr} (see benchmarks/zoo)")
    if not callable(module.build):
        raise TypeError(f"zoo case {module.__name__}: build must be callable")
    unknown = set(module.EXPECT) - EXPECT_KEYS
    if unknown:
        raise ValueError(
            f"zoo case {module.__name__}: EXPECT keys {sorted(unknown)} are not among "
            f"{sorted(EXPECT_KEYS)}"
        )
    return module


def discover() -> Iterator[ModuleType]:
    """Every case module of the zoo, checked, in file-name order."""
    names = set()
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = _check(importlib.import_module(f"{__name__}.{info.name}"))
        if module.NAME in names:
            raise ValueError(f"two zoo cases are named {module.NAME!r}")
        names.add(module.NAME)
        yield module


def load(name: str) -> ModuleType:
    """The case whose ``NAME`` is ``name``."""
    for module in discover():
        if module.NAME == name:
            return module
    raise KeyError(f"no zoo case named {name!r}; known: {[m.NAME for m in discover()]}")
