"""The corpus: every ``# expect: AGxxx`` line must fire exactly that code, and nothing else may."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ampguard.lint import lint_paths

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


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_corpus_file_gives_exactly_the_expected_findings(path: Path) -> None:
    found = {(f.line, f.code) for f in lint_paths([path], torch_version="2.13")}
    assert found == _expected(path)


def test_every_rule_has_a_firing_and_a_quiet_corpus_file() -> None:
    firing = {code for path in FILES for _, code in _expected(path)}
    assert firing == {f"AG{n}" for n in range(201, 215)}
    quiet = {p.stem.split("_")[0].upper() for p in FILES if p.stem.endswith(("_ok",))}
    assert quiet == {f"AG{n}" for n in range(201, 215)}
