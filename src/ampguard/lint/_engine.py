"""Running the rules: code selection, per-file checks, ``# noqa``, and walking folders."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import gc
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache

from ampguard.findings import Finding
from ampguard.lint._model import FileModel
from ampguard.lint._project import Project
from ampguard.lint._source import Parsed, noqa_codes, parse, physical_lines, syntax_finding
from ampguard.lint.rules import RULES, Context

__all__ = [
    "DEFAULT_EXCLUDES",
    "Options",
    "iter_python_files",
    "lint_bytes",
    "make_options",
    "parse_codes",
    "relaxed_gc",
]

DEFAULT_EXCLUDES = (
    ".git",
    ".hg",
    ".svn",
    ".venv",
    "venv",
    "__pycache__",
    "build",
    "dist",
    "node_modules",
    ".tox",
    ".nox",
    ".eggs",
    "*.egg-info",
    "site-packages",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
)
_GC_GEN0 = 50_000  # allocations between young collections while linting (CPython's default: 700)
_CODE = re.compile(r"^AG\d{0,3}$")
_TRIGGERS = {code: (r.triggers, tuple(t.encode() for t in r.triggers)) for code, r in RULES.items()}
_REQUIRES = {code: (r.requires, tuple(t.encode() for t in r.requires)) for code, r in RULES.items()}


@dataclass(frozen=True)
class Options:
    """What a run checks: the enabled codes and the torch version AG208 assumes."""

    codes: frozenset[str]
    torch_version: tuple[int, int] | None


def parse_codes(value: str | Iterable[str] | None, argument: str) -> list[str]:
    """``"AG201,AG21"`` or ``["AG201"]`` -> validated code prefixes (``ALL`` allowed)."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{argument} must hold code strings, got {item!r}")
        code = item.strip().upper()
        if not code:
            continue
        if code != "ALL" and not (_CODE.match(code) and any(c.startswith(code) for c in RULES)):
            raise ValueError(
                f"{argument}: unknown code {item.strip()!r}; known codes are "
                f"{min(RULES)}..{max(RULES)} (prefixes such as AG20 and ALL work)"
            )
        out.append(code)
    return out


def _matches(code: str, prefixes: list[str]) -> bool:
    return any(p == "ALL" or code.startswith(p) for p in prefixes)


def make_options(
    select: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
    torch_version: str | None = None,
) -> Options:
    """Validate the user's choices into :class:`Options`."""
    chosen = parse_codes(select, "select") or ["ALL"]
    dropped = parse_codes(ignore, "ignore")
    codes = frozenset(c for c in RULES if _matches(c, chosen) and not _matches(c, dropped))
    if torch_version is None:
        version = _installed_torch()
    elif isinstance(torch_version, str):
        version = _version(torch_version)
        if version is None:
            raise ValueError(
                f"torch_version must look like '2.5' or '2.5.1', got {torch_version!r}"
            )
    else:
        raise TypeError(f"torch_version must be a version string or None, got {torch_version!r}")
    return Options(codes, version)


def _version(text: str) -> tuple[int, int] | None:
    match = re.match(r"^\s*(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


@lru_cache(maxsize=1)
def _installed_torch() -> tuple[int, int] | None:
    """The installed torch's version, read from its metadata (torch itself is not imported)."""
    from importlib import metadata

    try:
        return _version(metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def relaxed_gc() -> Iterator[None]:
    """Run a lint of many files with fewer cyclic garbage collections (restored on exit).

    Parsing allocates millions of AST nodes that live until their file is done; with CPython's
    default thresholds the collector walks them again and again (a quarter of project mode's
    time over a 16k-line repository). Young collections still run every :data:`_GC_GEN0`
    allocations, so memory stays bounded; the thresholds the process had are put back, also on
    an exception. Cost: none beyond the collections it saves.
    """
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], _GC_GEN0), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def lint_bytes(
    source: str | bytes, path: str, options: Options, project: Project | None = None
) -> list[Finding]:
    """All findings for one file's contents, ``# noqa`` applied, unsorted.

    With ``project`` (project mode), names imported from the other files of the run resolve.
    """
    parsed = parse(source, path) if project is None else project.linted(path, source)
    if isinstance(parsed, Finding):
        return [parsed] if "AG200" in options.codes else []
    checks = [
        check
        for c in sorted(options.codes)
        if (check := RULES[c].check) is not None
        and _mentions(source, _TRIGGERS[c])
        and (not _REQUIRES[c][0] or _mentions(source, _REQUIRES[c]))
    ]
    if not checks:
        return []
    try:
        if project is None:
            model = FileModel(parsed.tree, path, project)
        else:
            model = project.model_for(path, parsed)
            project.begin(path, model)
        ctx = Context(model, path, options.torch_version)
        # a rule may add an AG200 note (a unit over the analysis budget): it obeys select/ignore
        findings = [f for check in checks for f in check(ctx) if f.code in options.codes]
    except RecursionError:
        message = "cannot analyse: the code is nested too deeply"
        return [syntax_finding(path, message)] if "AG200" in options.codes else []
    return _finish(findings, parsed)


def _mentions(source: str | bytes, texts: tuple[tuple[str, ...], tuple[bytes, ...]]) -> bool:
    """Whether ``source`` contains one of ``texts`` (given both as text and as UTF-8 bytes)."""
    if isinstance(source, bytes):
        return any(t in source for t in texts[1])
    return any(t in source for t in texts[0])


def _finish(findings: list[Finding], parsed: Parsed) -> list[Finding]:
    if not findings:
        return []
    lines = [line.rstrip("\r\n") for line in physical_lines(parsed.text)]
    out: dict[tuple, Finding] = {}
    for finding in findings:
        line = finding.line or 1
        end = int(finding.evidence.get("end_line", line))
        if _silenced(finding.code, lines, line) or (
            end != line and _silenced(finding.code, lines, end)
        ):
            continue
        text = lines[line - 1] if 0 < line <= len(lines) else ""
        col = finding.col or 1
        if not text.isascii():  # ast columns count UTF-8 bytes; editors count characters
            col = len(text.encode()[: col - 1].decode("utf-8", "ignore")) + 1
            finding = dataclasses.replace(finding, col=col)
        out.setdefault((finding.code, line, col, finding.message), finding)
    return list(out.values())


def _silenced(code: str, lines: list[str], line: int) -> bool:
    if not 0 < line <= len(lines):
        return False
    codes = noqa_codes(lines[line - 1])
    return codes is None or (codes is not False and code in codes)


def _excluded(name: str, rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)


def iter_python_files(
    paths: Iterable[str | os.PathLike], exclude: Iterable[str] = ()
) -> Iterator[str]:
    """Files to lint: each file named, and the ``*.py`` files under each folder named.

    Folders skip :data:`DEFAULT_EXCLUDES` and ``exclude`` (glob patterns matched against a name
    or a path relative to the folder given). Symlinked folders are not followed, so a symlink
    loop ends the walk; named paths that are not folders are yielded as they are (the reader
    reads regular files only and reports the rest as AG200). A file reached by several names
    (a symlink to a module) is yielded once, under its real name when that is among them.
    """
    patterns = (*DEFAULT_EXCLUDES, *exclude)
    found = list(_walk(paths, patterns, tuple(exclude)))
    # one file reached by several names is linted once, under its real name when the walk
    # meets it too (a symlink that sorts first must not take the module's name away: project
    # mode resolves imports by the real file)
    chosen: dict[str, str] = {}
    for path in found:
        key = os.path.realpath(path)
        if key not in chosen or (os.path.islink(chosen[key]) and not os.path.islink(path)):
            chosen[key] = path
    for path in found:
        key = os.path.realpath(path)
        if chosen.get(key) == path:
            del chosen[key]
            yield path


def _walk(
    paths: Iterable[str | os.PathLike], patterns: tuple[str, ...], exclude: tuple[str, ...]
) -> Iterator[str]:
    for raw in paths:
        path = os.fspath(raw)
        if not os.path.isdir(path):
            if not os.path.lexists(path):
                raise FileNotFoundError(f"paths: no such file or folder: {path!r}")
            yield path  # a file, or a FIFO / device / dangling link: the reader reports it
            continue
        for root, dirs, files in os.walk(path):
            rel_root = os.path.relpath(root, path)
            dirs[:] = sorted(
                d
                for d in dirs
                if not _excluded(d, os.path.normpath(os.path.join(rel_root, d)), patterns)
            )
            for name in sorted(files):
                rel = os.path.normpath(os.path.join(rel_root, name))
                if name.endswith(".py") and not _excluded(name, rel, exclude):
                    yield os.path.normpath(os.path.join(root, name))
