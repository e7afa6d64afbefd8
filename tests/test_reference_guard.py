"""The API reference documents every Guard argument: a Google-style Args
section that mkdocstrings renders as a parameter table, no raw reST roles, no private module
names, no files that are not in the repository; the fp8 page's example names the default recipe."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import ampguard as ag

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`")
PRIVATE_MODULE = re.compile(r"\bampguard(?:\.\w+)*\._\w+")


def _args_section(doc: str) -> dict[str, str]:
    body = doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0]
    out: dict[str, str] = {}
    for line in body.splitlines():
        m = re.match(r"    (\w+): (.*)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _guard_docs() -> dict[str, str]:
    docs = {"Guard": inspect.getdoc(ag.Guard) or ""}
    for name, obj in vars(ag.Guard).items():
        if name.startswith("_"):
            continue
        target = obj.fget if isinstance(obj, property) else obj
        docs[name] = inspect.getdoc(target) or ""
    return docs


def test_every_guard_argument_has_an_entry():
    params = [p for p in inspect.signature(ag.Guard).parameters if p != "self"]
    documented = _args_section(inspect.getdoc(ag.Guard))
    assert list(documented) == params  # all of them, in signature order
    assert all(len(text) > 20 for text in documented.values())


def test_griffe_parses_the_args_as_a_parameter_table():
    griffe = pytest.importorskip("griffe", reason="griffe comes with the docs extra")
    doc = griffe.Docstring(inspect.getdoc(ag.Guard), parser="google")
    sections = doc.parse()
    (params,) = [s for s in sections if s.kind.value == "parameters"]
    names = [p.name for p in params.value]
    assert names == [p for p in inspect.signature(ag.Guard).parameters if p != "self"]


@pytest.mark.parametrize("name", sorted(_guard_docs()))
def test_guard_docstrings_have_no_raw_roles_or_private_modules(name):
    doc = _guard_docs()[name]
    assert not ROLE.search(doc), ROLE.search(doc)
    assert not PRIVATE_MODULE.search(doc), PRIVATE_MODULE.search(doc)


def test_the_reference_page_names_only_files_in_the_repository():
    text = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    for name in set(re.findall(r"\b[\w./-]+\.(?:md|py|toml|yml)\b", text)):
        assert (ROOT / name).exists() or (ROOT / "docs" / name).exists(), name


def test_the_fp8_page_example_says_which_recipe_is_the_default():
    default = inspect.signature(ag.fp8_plan).parameters["recipe"].default
    page = (ROOT / "docs" / "fp8.md").read_text(encoding="utf-8")
    start = page.index("plan = ag.fp8_plan(model, loss_fn, batch)")
    comment = page[start : page.index("print(plan.summary())", start)]
    assert "default\n" in comment or "the default" in comment
    assert f'"{default}"' in comment
