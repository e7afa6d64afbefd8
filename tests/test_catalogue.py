"""The catalogue of finding codes is the one source: docs tables, Finding, make and the emitters.

Every markdown table row in README.md and docs/**/*.md whose first cell is a code (``| AG101 |``,
``| `AG101` |``, ``| [AG101](#ag101) |``, ``| AG213 (info) |``), or whose second cell is one (the
compare table: ``| `amp_ok` | AG333 |``), must name a catalogued code; where the table has a
``severity`` column (or the code cell says ``(info)``) it must match the code's default severity.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ampguard.findings import SEVERITIES, Finding, make
from ampguard.findings.codes import CATALOGUE, lookup

ROOT = Path(__file__).resolve().parents[1]
_CODE = re.compile(r"^(?:`(AG\d{3})`|\[`?(AG\d{3})`?\]\([^)]*\)|(AG\d{3}))(?:\s*\((\w+)\))?$")
_SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?$")
_SEVERITY_WORD = re.compile(r"\b(" + "|".join(SEVERITIES) + r")\b")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _code_of(cell: str) -> tuple[str, str | None] | None:
    m = _CODE.match(cell)
    return None if m is None else (next(g for g in m.groups()[:3] if g), m.group(4))


def table_rows(text: str) -> list[tuple[int, str, set[str]]]:
    """(line number, code, severities the row states) for each code row of a markdown text."""
    out = []
    header: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            header = []
            continue
        if _SEPARATOR.match(line.strip()):
            continue
        cells = _cells(line)
        if i + 1 < len(lines) and _SEPARATOR.match(lines[i + 1].strip()):
            header = [c.lower() for c in cells]
            continue
        found = _code_of(cells[0]) or (_code_of(cells[1]) if len(cells) > 1 else None)
        if found is None:
            continue
        code, inline = found
        stated = {inline} if inline in SEVERITIES else set()
        for name, cell in zip(header, cells, strict=False):
            if name == "severity":
                stated |= set(_SEVERITY_WORD.findall(cell))
        out.append((i + 1, code, stated))
    return out


def problems(text: str) -> list[str]:
    """What is wrong with the code rows of one markdown text, one line per problem."""
    bad = []
    for line, code, stated in table_rows(text):
        if code not in CATALOGUE:
            bad.append(f"line {line}: {code} is not in the catalogue")
        elif stated and CATALOGUE[code].severity not in stated:
            bad.append(
                f"line {line}: {code} is {'/'.join(sorted(stated))} here but "
                f"{CATALOGUE[code].severity} in the catalogue"
            )
    return bad


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_scanner_reads_the_table_forms() -> None:
    text = "\n".join(
        [
            "| code | severity | title |",
            "|---|---|---|",
            "| AG101 | error | x |",
            "| `AG102` | warning | x |",
            "| [AG103](#ag103) | warning | x |",
            "| AG999 | info | x |",
            "",
            "| verdict | code |",
            "| --- | --- |",
            "| `amp_ok` | AG333 |",
            "",
            "| code | catches |",
            "|---|---|",
            "| AG213 (warning) | x |",
            "| AG201 | x |",
            "| not a code | AG2010 |",
        ]
    )
    rows = [(code, stated) for _, code, stated in table_rows(text)]
    assert rows == [
        ("AG101", {"error"}),
        ("AG102", {"warning"}),
        ("AG103", {"warning"}),
        ("AG999", {"info"}),
        ("AG333", set()),
        ("AG213", {"warning"}),
        ("AG201", set()),
    ]
    assert problems(text) == [
        "line 6: AG999 is not in the catalogue",
        "line 14: AG213 is warning here but info in the catalogue",
    ]


def test_docs_code_tables_match_the_catalogue() -> None:
    bad, seen = [], set()
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        bad += [f"{page.relative_to(ROOT)} {p}" for p in problems(text)]
        seen |= {code for _, code, _ in table_rows(text)}
    assert not bad, "\n".join(bad)
    # the scan finds the tables: the generated catalogue lists every code, README the verdicts
    assert seen >= set(CATALOGUE)
    # ... and each capability page holds its own table (the README links to them)
    for page, code in (
        ("telemetry", "AG101"),
        ("lint", "AG201"),
        ("forensics", "AG301"),
        ("compare", "AG333"),
        ("fp8", "AG340"),
    ):
        text = (ROOT / "docs" / f"{page}.md").read_text("utf-8")
        assert code in {c for _, c, _ in table_rows(text)}, (page, code)


def test_every_code_is_documented_on_the_findings_page() -> None:
    text = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    rows = {code: stated for _, code, stated in table_rows(text)}
    for code, entry in CATALOGUE.items():
        assert re.search(rf"^### {code}: ", text, re.M), f"{code} has no section on findings.md"
        assert rows.get(code) == {entry.severity}, code
        assert entry.doc and (ROOT / "docs" / entry.doc).is_file(), code


def test_catalogue_entries_are_well_formed() -> None:
    for code, entry in CATALOGUE.items():
        assert re.fullmatch(r"AG\d{3}", code) and entry.code == code
        assert entry.severity in SEVERITIES and entry.title and entry.fix and entry.fires


def test_every_code_is_in_a_family_and_the_findings_page_names_the_families() -> None:
    from ampguard.findings.codes import FAMILIES, family

    assert {family(code) for code in CATALOGUE} == set(FAMILIES)
    with pytest.raises(KeyError, match=r"'AG999' is in no family"):
        family("AG999")
    text = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    assert all(f"{prefix}xx {what}" in text for prefix, what in FAMILIES.items())


def test_finding_refuses_an_unknown_code() -> None:
    with pytest.raises(ValueError, match=r"'AG999'.*catalogue.*CATALOGUE"):
        Finding("AG999", "error", "t", "m")
    with pytest.raises(ValueError, match="AGnnn"):
        Finding("XX101", "error", "t", "m")
    with pytest.raises(ValueError, match="AG999"):
        Finding.from_dict({"code": "AG999", "severity": "info", "title": "t", "message": "m"})
    assert Finding("AG101", "warning", "any title", "m").code == "AG101"


def test_lookup_names_the_code() -> None:
    assert lookup("AG301") is CATALOGUE["AG301"]
    with pytest.raises(KeyError, match=r"'AG999'.*catalogue"):
        lookup("AG999")


def test_make_fills_in_the_catalogue() -> None:
    f = make("AG105", "fc1 came within 16x of 65504", step=7, evidence={"layer": "fc1"})
    entry = CATALOGUE["AG105"]
    assert (f.code, f.severity, f.title, f.fix) == ("AG105", entry.severity, entry.title, entry.fix)
    assert (f.message, f.step, f.evidence) == ("fc1 came within 16x of 65504", 7, {"layer": "fc1"})
    assert f.path is None and make("AG105", "m").evidence == {}


def test_make_overrides_and_detail() -> None:
    f = make("AG101", "m", severity="warning", fix="do this", path="a.py", line=3, col=1)
    assert (f.severity, f.fix, f.path, f.line, f.col) == ("warning", "do this", "a.py", 3, 1)
    assert make("AG310", "m", detail="'fc1'").title == "module escaped autocast: 'fc1'"
    assert make("AG310", "m", title="custom").title == "custom"
    with pytest.raises(KeyError, match="AG999"):
        make("AG999", "m")
    with pytest.raises(ValueError, match="severity"):
        make("AG101", "m", severity="fatal")


def test_run_log_schema_refuses_an_unknown_code() -> None:
    from ampguard.runlog._schema import check_finding

    ok = {"code": "AG301", "severity": "error", "title": "t", "message": "m"}
    assert check_finding(ok) is None
    assert "AG999" in (check_finding({**ok, "code": "AG999"}) or "")


def test_lint_rules_and_runtime_titles_come_from_the_catalogue() -> None:
    from ampguard.lint.rules import RULES, Rule
    from ampguard.rules import TITLES

    for code, rule in RULES.items():
        assert (rule.severity, rule.title) == (CATALOGUE[code].severity, CATALOGUE[code].title)
    assert set(RULES) == {c for c, e in CATALOGUE.items() if e.area == "lint"}
    assert TITLES == {c: e.title for c, e in CATALOGUE.items() if c.startswith("AG1")}
    rule = Rule.from_code("AG209", triggers=("softmax",))
    assert rule.fix == CATALOGUE["AG209"].fix and rule.check is None


def test_verdict_and_plan_codes_are_catalogued() -> None:
    from ampguard.experiments import _verdict

    assert set(_verdict.CODES) == set(_verdict.VERDICTS)
    assert all(code in CATALOGUE for code in _verdict.CODES.values())


def test_forensics_titles_start_with_the_catalogue_title() -> None:
    from ampguard.forensics import Diagnosis

    cases = [
        Diagnosis("none", None, None, None),
        Diagnosis("fp16_overflow", "forward", "fc1", "aten.mm"),
        Diagnosis("fp16_overflow", "backward", "fc1", "aten.mm", precision="bf16"),
        Diagnosis("fp16_underflow", "backward", "fc1", None),
        Diagnosis("model_nonfinite", "forward", "fc1", "aten.log"),
        Diagnosis("input_nonfinite", "forward", "fc1", "aten.mm"),
        Diagnosis("none", "backward", "fc1", "aten.mm", benign=True),
    ]
    for d in cases:
        f = d.to_finding(step=3)
        assert f.severity == CATALOGUE[f.code].severity
        assert f.title.startswith(CATALOGUE[f.code].title), (f.code, f.title)
    assert cases[1].to_finding().title == "fp16 overflow in the forward pass at 'fc1'"
