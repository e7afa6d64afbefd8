"""The docs stay true to the code: every public name has a reference entry, every code the source
can emit is in the catalogue and on the findings page, the README's links resolve, the README
split into pages builds with ``mkdocs build --strict``, and the quickstart example runs."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ampguard
from ampguard.findings.codes import CATALOGUE, EXAMPLES
from ampguard.lint import lint_source

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "ampguard"
NAV_PAGE = re.compile(r":\s*([\w./-]+\.md)\s*$", re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _tool(name: str):  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _public() -> list[str]:
    return [n for n in ampguard.__all__ if n != "__version__"]


# ---------------------------------------------------------------------- reference and catalogue
def test_every_public_name_has_a_reference_entry():
    page = (DOCS / "reference.md").read_text(encoding="utf-8")
    missing = [n for n in _public() if f"::: ampguard.{n}\n" not in page]
    assert not missing, f"no reference entry for {missing}: run python tools/gen_docs.py"


def test_the_generated_pages_are_up_to_date():
    assert _tool("gen_docs").main(["--check"]) == 0, "run python tools/gen_docs.py"


def test_every_catalogue_code_has_a_section_on_the_findings_page():
    page = (DOCS / "findings.md").read_text(encoding="utf-8")
    missing = [
        c for c in CATALOGUE if f"### {c}: " not in page or f"{{ #{c.lower()} }}" not in page
    ]
    assert not missing


def test_every_code_the_source_emits_is_in_the_catalogue():
    emitted: dict[str, str] = {}
    for path in SRC.rglob("*.py"):
        for code in re.findall(r"""["'](AG\d{3})["']""", path.read_text(encoding="utf-8")):
            emitted.setdefault(code, str(path.relative_to(ROOT)))
    assert len(emitted) > 40  # the grep finds the codes at all
    unknown = {c: where for c, where in emitted.items() if c not in CATALOGUE}
    assert not unknown, (
        f"codes used in src but missing from ampguard.findings.codes.CATALOGUE: {unknown}"
    )


@pytest.mark.parametrize("code", sorted(EXAMPLES))
def test_each_lint_example_fires_its_code(code):
    assert code in {f.code for f in lint_source(EXAMPLES[code])}
    assert CATALOGUE[code].example == EXAMPLES[code]


def test_the_type_checking_imports_mirror_the_lazy_exports():
    tree = ast.parse((SRC / "__init__.py").read_text(encoding="utf-8"))
    guarded = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                guarded.update({a.asname or a.name: imp.module for a in imp.names})
    assert guarded == ampguard._EXPORTS


# ---------------------------------------------------------------------- README
def _relative_links(text: str) -> list[str]:
    return [
        t.split("#")[0]
        for t in LINK.findall(text)
        if not re.match(r"[a-z]+:", t) and not t.startswith("#")
    ]


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    broken = [t for t in _relative_links(readme) if not (ROOT / t).exists()]
    assert not broken


def test_readme_has_two_setup_commands_and_ci_runs_the_test_command_as_written():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.endswith("&& ampguard demo") and '".[dev]"' in tests
    test_command = tests.rsplit("&& ", 1)[1]
    assert test_command.startswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"\n{test_command}\n" in ci  # CI runs it exactly as the README writes it
    quick = re.search(r'`(python -m pytest -q -m "not slow" -n 2)`', setup)
    assert quick is not None  # the quick tier is offered, and the marker it names is registered
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '"slow: ' in pyproject and "--strict-markers" in pyproject
    assert '"pytest-xdist==' in pyproject  # what -n needs is in the dev extra


def test_readme_run_folders_match_the_demo_default():
    from ampguard.demo import run_demo

    default = inspect.signature(run_demo).parameters["out"].default
    texts = [p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *DOCS.glob("*.md")]]
    folders = [f for t in texts for f in re.findall(r"^ +run folder: +(\S+)", t, re.M)]
    assert folders and all(f == default for f in folders), (folders, default)


# ---------------------------------------------------------------------- split and build
@pytest.fixture(scope="module")
def split_copy(tmp_path_factory) -> Path:
    """A scratch copy of what the docs need, with the README split into pages."""
    root = tmp_path_factory.mktemp("split")
    for name in ("docs", "src", "tools"):
        shutil.copytree(
            ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "site")
        )
    for name in ("README.md", "CHANGELOG.md", "mkdocs.yml"):
        shutil.copy2(ROOT / name, root / name)
    short = root / "README.md"
    if _tool("split_readme").main(["--root", str(root)]) != 0:
        pytest.fail("split_readme failed")
    assert short.stat().st_size <= 10_240
    return root


def test_split_writes_every_page_of_the_nav(split_copy):
    nav = NAV_PAGE.findall((split_copy / "mkdocs.yml").read_text(encoding="utf-8"))
    assert len(nav) >= 15
    assert [p for p in nav if not (split_copy / "docs" / p).exists()] == []


def test_the_short_readme_keeps_the_setup_commands_and_its_links_resolve(split_copy):
    full = (ROOT / "README.md").read_text(encoding="utf-8")
    short = (split_copy / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"^python3 -m venv .*$", full, re.M)
    assert len(commands) == 2 and all(c in short for c in commands)
    assert "docs/img/report.png" in short and "ag.Guard(" in short
    links = _relative_links(short)
    assert "docs/reference.md" in links and "docs/findings.md" in links
    assert [t for t in links if not (split_copy / t).exists()] == []
    # run again on the short README: nothing changes
    assert _tool("split_readme").main(["--root", str(split_copy)]) == 0
    assert (split_copy / "README.md").read_text(encoding="utf-8") == short


def test_the_split_pages_keep_their_code_blocks_whole(split_copy):
    for page in (split_copy / "docs").glob("*.md"):
        assert page.read_text(encoding="utf-8").count("```") % 2 == 0, page.name


@pytest.mark.skipif(
    shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed (pip install -e '.[docs]')",
)
@pytest.mark.slow  # a full mkdocs build in a subprocess
def test_mkdocs_build_strict_passes_on_the_split_docs(split_copy, tmp_path):
    (split_copy / "docs" / "img").mkdir(exist_ok=True)
    if not (split_copy / "docs" / "img" / "report.png").exists():  # made by screenshot_report
        shutil.copy2(ROOT / "docs" / "img" / "report.png", split_copy / "docs" / "img")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=split_copy,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "PATH": "/usr/bin:/bin",
            "NO_MKDOCS_2_WARNING": "1",
            "PYTHONPATH": str(split_copy / "src"),
            "HOME": str(tmp_path),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text(encoding="utf-8")
    assert all(f'id="ampguard.{n}"' in reference for n in _public())


def test_doctest_blocks_become_code_fences():
    pytest.importorskip(
        "griffe", reason="griffe comes with the docs extra (pip install -e '.[docs]'); CI has it"
    )
    fence = _tool("griffe_doctest").fence_doctests
    text = "Summary.\n\n>>> x = f()\n>>> [c for c in x]\n['AG310']\n\nAfter."
    assert fence(text) == (
        "Summary.\n\n```python\n>>> x = f()\n>>> [c for c in x]\n['AG310']\n```\n\nAfter."
    )


# ---------------------------------------------------------------------- the example
@pytest.mark.slow  # a fresh interpreter trains and writes the report
def test_the_quickstart_example_runs_and_writes_the_report(tmp_path):
    script = DOCS / "examples" / "quickstart.py"
    assert len(script.read_text(encoding="utf-8").splitlines()) <= 20
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps skipped, loss scale" in proc.stdout
    assert (tmp_path / "ampguard-runs" / "quickstart" / "report.html").exists()
