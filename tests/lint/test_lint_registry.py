"""The lint rules are found, not listed: every public module of ``ampguard.lint.rules`` adds the
rules it names in ``__all__``, so adding a rule touches no import list or tuple."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import ampguard.lint.rules as rules_package
from ampguard.findings.codes import CATALOGUE
from ampguard.lint import RULES, Rule
from ampguard.lint.rules._registry import discover

RULE = (
    "from ampguard.lint.rules._base import Rule\n"
    '__all__ = ["{name}"]\n'
    '{name} = Rule.from_code("{code}", triggers=("x",))\n'
)


def test_rules_are_every_rule_the_public_modules_name() -> None:
    named: dict[str, str] = {}
    for info in pkgutil.iter_modules(rules_package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"ampguard.lint.rules.{info.name}")
        declared = [r for n in module.__all__ if isinstance(r := getattr(module, n), Rule)]
        assert declared, f"{info.name} declares no rule"
        named.update({r.code: info.name for r in declared})
    assert set(RULES) == set(named) == {c for c, e in CATALOGUE.items() if e.area == "lint"}
    assert list(RULES) == sorted(RULES)


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a folder
    root = tmp_path / "extra_rules"
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m == "extra_rules" or m.startswith("extra_rules.")]:
        del sys.modules[name]


def test_a_new_module_is_picked_up_and_private_modules_are_not(package: Path) -> None:
    (package / "softmax_rule.py").write_text(RULE.format(name="AG209", code="AG209"))
    (package / "_helpers.py").write_text(RULE.format(name="AG210", code="AG210"))
    found = discover("extra_rules")
    assert list(found) == ["AG209"] and found["AG209"].title == CATALOGUE["AG209"].title


def test_a_code_declared_twice_names_both_modules(package: Path) -> None:
    (package / "one.py").write_text(RULE.format(name="AG209", code="AG209"))
    (package / "two.py").write_text(RULE.format(name="AG209", code="AG209"))
    with pytest.raises(
        RuntimeError, match=r"AG209 is declared twice: in extra_rules\.one and extra_rules\.two"
    ):
        discover("extra_rules")


def test_the_lint_page_has_a_row_for_every_rule() -> None:
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "lint.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| (AG2\d\d)(?: \(\w+\))? \|", page, re.M))
    assert rows >= set(RULES), sorted(set(RULES) - rows)
