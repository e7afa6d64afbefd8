"""Split the README's ``## `` sections into the docs' capability pages and write the short README.

    python tools/split_readme.py                       # docs/*.md from README.md, README shrunk
    python tools/split_readme.py --root /tmp/copy      # the same on a scratch copy
    python tools/split_readme.py --pages-only          # write the pages, keep README.md as it is

Each ``## Title`` section becomes a page (``# Title``, its ``###`` headings one level up; code
fences are left alone) chosen by the first keyword rule in ``PAGES`` that the title matches. The
"API at a glance" section goes into ``docs/reference.md`` between the ``api-at-a-glance``
markers; "Set up" stays in the short README (``docs/getting-started.md`` is written by hand).
A section that no rule matches stops the script with its title, so a new README section is
never dropped silently. A page whose section does not exist yet (fp8, architecture) is written
from what the code already says: the finding codes of its area from ``ampguard.findings.codes`` or
the
package's module map.

The short README keeps the README's opening (title and what ampguard is), its "Set up" section
as it is (the two commands), the 20-line example ``docs/examples/quickstart.py``, the report's
screenshot ``docs/img/report.png`` and links into the docs. It must stay under ``MAX_README``
bytes. On the short README (it carries ``SHORT_MARK``) the script does nothing.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_README = 10_240
DOCS_URL = "docs/"

# (keywords any of which the lower-cased title starts with or contains, page, nav title)
PAGES: list[tuple[tuple[str, ...], str, str]] = [
    (("the guarded step", "guarded step"), "guarded-step.md", "The guarded step"),
    (("checkpoint",), "checkpoints.md", "Checkpoints"),
    (("telemetry",), "telemetry.md", "Telemetry, findings and the report"),
    (("forensics",), "forensics.md", "Forensics"),
    (("autocast coverage", "coverage"), "coverage.md", "Autocast coverage"),
    (("a/b experiments", "compare", "advisor"), "compare.md", "Compare and the advisor"),
    (("fp8",), "fp8.md", "fp8"),
    (("lint",), "lint.md", "Lint"),
    (("distributed",), "distributed.md", "Distributed"),
    (("integrations",), "integrations.md", "Integrations"),
    (("architecture", "package layout", "how it is built"), "architecture.md", "Architecture"),
    (("performance",), "performance.md", "Performance"),
]
KEEP_IN_README = ("set up",)
API_SECTION = ("api at a glance",)
API_START, API_END = "<!-- api-at-a-glance:start -->", "<!-- api-at-a-glance:end -->"
SHORT_MARK = "<!-- The short README, written by tools/split_readme.py; the rest is in docs/. -->"

# what a page without its README section says it covers (fp8 and architecture may come later)
MISSING = {
    "fp8.md": (
        "fp8",
        "fp8 training: the precision, its run-time telemetry and the plan that says which "
        "layers can take it. The finding codes of this area:",
        ("fp8",),
    ),
    "architecture.md": (
        "Architecture",
        "How the package is built: one concept per module. The modules, each with "
        "the first line of its docstring:",
        (),
    ),
}


def _sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The opening (before the first ``## ``) and each ``## `` section's title and body;
    a ``## `` inside a code fence is not a heading."""
    head: list[str] = []
    out: list[tuple[str, list[str]]] = []
    fence = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        if not fence and line.startswith("## "):
            out.append((line[3:].strip(), []))
            continue
        (out[-1][1] if out else head).append(line)
    return "\n".join(head).strip() + "\n", [(t, "\n".join(b).strip() + "\n") for t, b in out]


def _promote(body: str) -> str:
    """``###`` -> ``##`` (and deeper alike) outside code fences."""
    lines, fence = [], False
    for line in body.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        if not fence and re.match(r"#{3,6} ", line):
            line = line[1:]
        lines.append(line)
    return "\n".join(lines) + "\n"


def _page_for(title: str) -> str | None:
    low = title.lower()
    for keys, page, _ in PAGES:
        if any(low.startswith(k) or k in low for k in keys):
            return page
    return None


def _module_map(src: Path) -> str:
    rows = ["| module | what it is |", "| --- | --- |"]
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src.parent).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if any(p.startswith("_") for p in parts[1:]):
            continue  # private modules: the public ones say what the package does
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        first = doc.strip().splitlines()[0] if doc.strip() else ""
        rows.append(f"| `{'.'.join(parts)}` | {first.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def _missing_page(root: Path, page: str) -> str:
    title, lead, areas = MISSING[page]
    if areas:
        sys.path.insert(0, str(root / "src"))
        from ampguard.findings.codes import CATALOGUE

        rows = [
            f"- [{c.code}](findings.md#{c.code.lower()}) ({c.severity}): {c.title}"
            for c in CATALOGUE.values()
            if c.area in areas
        ]
        body = "\n".join(rows) + "\n" if rows else "This version has no fp8 support yet.\n"
        return (
            f"# {title}\n\n{lead}\n\n{body}\nSee the [API reference](reference.md) for the names.\n"
        )
    return f"# {title}\n\n{lead}\n\n{_module_map(root / 'src' / 'ampguard')}"


def write_pages(root: Path, sections: list[tuple[str, str]]) -> dict[str, str]:
    """Write each section to its page; return page -> title. Exits on an unmapped title."""
    docs = root / "docs"
    unmapped = [
        t
        for t, _ in sections
        if _page_for(t) is None and not t.lower().startswith(KEEP_IN_README + API_SECTION)
    ]
    if unmapped:
        sys.exit(
            f"split_readme: no docs page for README section(s) {unmapped}: add a rule "
            "to PAGES in tools/split_readme.py"
        )
    bodies: dict[str, list[str]] = {}
    titles: dict[str, str] = {}
    for title, body in sections:
        low = title.lower()
        if low.startswith(API_SECTION):
            _write_api(docs / "reference.md", body)
            continue
        page = _page_for(title)
        if page is None:
            continue
        # a second section for the same page joins it as a sub-section
        bodies.setdefault(page, []).append(
            f"# {title}\n\n{_promote(body)}"
            if page not in titles
            else f"## {title}\n\n{_promote(body)}"
        )
        titles.setdefault(page, title)
    for _, page, _nav in PAGES:
        if page in bodies:
            text = "\n".join(bodies[page])
        elif page in MISSING:
            text = _missing_page(root, page)
        else:
            continue
        (docs / page).write_text(text, encoding="utf-8")
    return titles


def _write_api(reference: Path, body: str) -> None:
    text = reference.read_text(encoding="utf-8")
    if API_START not in text or API_END not in text:
        sys.exit(f"split_readme: {reference} lacks the {API_START} / {API_END} markers")
    head, rest = text.split(API_START, 1)
    _, tail = rest.split(API_END, 1)
    reference.write_text(
        f"{head}{API_START}\n## At a glance\n\n{_promote(body)}{API_END}{tail}", encoding="utf-8"
    )


def short_readme(root: Path, opening: str, sections: list[tuple[str, str]]) -> str:
    """The first-visit README: opening, Set up, the example, the screenshot, links."""
    setup = next((b for t, b in sections if t.lower().startswith(KEEP_IN_README)), None)
    if setup is None:
        sys.exit("split_readme: the README has no '## Set up' section to keep")
    example = (root / "docs" / "examples" / "quickstart.py").read_text(encoding="utf-8")
    links = [f"- [Getting started]({DOCS_URL}getting-started.md)"]
    links += [
        f"- [{nav}]({DOCS_URL}{page})" for _, page, nav in PAGES if (root / "docs" / page).exists()
    ]
    links += [
        f"- [Troubleshooting, by symptom]({DOCS_URL}troubleshooting.md)",
        f"- [Findings catalogue: every AG code, what fires it, the fix]({DOCS_URL}findings.md)",
        f"- [API reference]({DOCS_URL}reference.md)",
        "- [Changelog](CHANGELOG.md)",
    ]
    return (
        f"{opening}\n## Set up\n\n{setup}\n## A guarded training loop\n\n```python\n{example}"
        "```\n\nThe report of a run (`ampguard demo`, then open the report it names):\n\n"
        "![ampguard report](docs/img/report.png)\n\n"
        "## Documentation\n\nThe docs site is built from `docs/` with "
        '`pip install -e ".[docs]" && mkdocs serve`:\n\n' + "\n".join(links) + f"\n\n{SHORT_MARK}\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this one)")
    ap.add_argument("--pages-only", action="store_true", help="keep README.md as it is")
    args = ap.parse_args(argv)
    readme = args.root / "README.md"
    text = readme.read_text(encoding="utf-8")
    if SHORT_MARK in text:
        print("split_readme: README.md is already the short one; the pages stay as they are")
        return 0
    opening, sections = _sections(text)
    titles = write_pages(args.root, sections)
    print(
        f"split_readme: {len(titles)} page(s) from README sections: "
        + ", ".join(f"{p} <- {t!r}" for p, t in titles.items())
    )
    if args.pages_only:
        return 0
    text = short_readme(args.root, opening, sections)
    size = len(text.encode("utf-8"))
    if size > MAX_README:
        sys.exit(f"split_readme: the short README would be {size} bytes (> {MAX_README})")
    readme.write_text(text, encoding="utf-8")
    print(f"split_readme: README.md is now {size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
