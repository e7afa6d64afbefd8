"""The corpus: every ``# expect: AGxxx`` line must fire exactly that code, and nothing else may.

``corpus/*.py`` are linted one by one; each ``corpus/proj_*/`` folder is a small project linted as
a whole (project mode: helpers, savers, scaler factories and autocast contexts in sibling files).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ampguard.lint import RULES, lint_paths

CORPUS = Path(__file__).parent / "corpus"
_EXPECT = re.compile(r"#\s*expect:\s*(AG\d{3}(?:\s*,\s*AG\d{3})*)")


def _expected(path: Path) -> set[tuple[int, str]]:
    out = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _EXPECT.search(line)
        if match:
            out.update((number, code.strip()) for code in match.group(1).split(","))
    return out


FILES = sorted(CORPUS.glob("*.py"))
PROJECTS = sorted(p for p in CORPUS.glob("proj_*") if p.is_dir())


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_corpus_file_gives_exactly_the_expected_findings(path: Path) -> None:
    found = {(f.line, f.code) for f in lint_paths([path], torch_version="2.13")}
    assert found == _expected(path)


# every rule with a check of its own (AG200 has none: it reports what the others cannot read)
CHECKED = {code for code, rule in RULES.items() if rule.check is not None}


def test_every_rule_has_a_firing_and_a_quiet_corpus_file() -> None:
    firing = {code for path in FILES for _, code in _expected(path)}
    assert CHECKED <= firing <= set(RULES)
    quiet = {p.stem.split("_")[0].upper() for p in FILES if p.stem.endswith(("_ok",))}
    assert quiet == CHECKED


def _project_expected(root: Path) -> set[tuple[str, int, str]]:
    return {
        (path.relative_to(root).as_posix(), line, code)
        for path in sorted(root.rglob("*.py"))
        for line, code in _expected(path)
    }


def _project_found(root: Path, project: bool = True) -> set[tuple[str, int, str]]:
    return {
        (Path(f.path).relative_to(root).as_posix(), f.line, f.code)
        for f in lint_paths([root], torch_version="2.13", project=project)
    }


@pytest.mark.parametrize("root", PROJECTS, ids=[p.name for p in PROJECTS])
def test_corpus_project_gives_exactly_the_expected_findings(root: Path) -> None:
    assert _project_found(root) == _project_expected(root)


@pytest.mark.parametrize("root", PROJECTS, ids=[p.name for p in PROJECTS])
def test_project_findings_need_project_mode(root: Path) -> None:
    """Each project holds at least one finding that only reading the sibling files can give."""
    alone = _project_found(root, project=False)
    assert alone < _project_found(root)


def test_project_corpus_covers_every_cross_file_pattern() -> None:
    codes = {code for root in PROJECTS for _, _, code in _project_expected(root)}
    assert {"AG201", "AG203", "AG205", "AG214"} <= codes
