"""The entry points of ``ampguard lint``: lint or fix a source string, files and folders."""

from __future__ import annotations

import os
from collections.abc import Iterable
from functools import partial

from ampguard._util.checks import check_bool
from ampguard.findings import Finding
from ampguard.lint._engine import (
    Options,
    iter_python_files,
    lint_bytes,
    make_options,
    relaxed_gc,
)
from ampguard.lint._fix import Fixed, decode, fix_text
from ampguard.lint._output import sort_findings
from ampguard.lint._project import Project
from ampguard.lint._source import read_source
from ampguard.lint._write import Snapshot, link_refusal, replace

__all__ = ["fix_paths", "fix_source", "lint_paths", "lint_source"]

Codes = str | Iterable[str] | None


def lint_source(
    text: str | bytes,
    filename: str = "<string>",
    *,
    select: Codes = None,
    ignore: Codes = None,
    torch_version: str | None = None,
) -> list[Finding]:
    """Lint one file's contents; returns sorted findings with ``path``/``line``/``col`` set.

    ``text`` may be ``bytes`` (read as Python reads a source file: UTF-8 unless a coding comment
    says otherwise). ``select``/``ignore`` take codes or prefixes (``"AG20"``, ``"ALL"``), as a
    comma-separated string or a list. ``torch_version`` is the torch AG208 assumes (default:
    the installed one, read from its metadata without importing torch). A file that does not
    parse gives one AG200 finding instead of an exception.
    """
    if not isinstance(text, (str, bytes)):
        raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
    if not isinstance(filename, str):
        raise TypeError(f"filename must be str, got {type(filename).__name__}")
    options = make_options(select, ignore, torch_version)
    return sort_findings(lint_bytes(text, filename, options))


def fix_source(
    text: str,
    filename: str = "<string>",
    *,
    select: Codes = None,
    ignore: Codes = None,
    torch_version: str | None = None,
) -> Fixed:
    """Apply the mechanical fixes (:data:`FIXABLE`: AG201, AG204, AG206, AG208) to one file's
    text; returns a :class:`Fixed` (``.text``, ``.fixed`` findings, ``.changed``).

    Each fix is a minimal edit at AST offsets (the rest of the text is kept byte for byte),
    idempotent (fixing ``.text`` again changes nothing), and leaves no finding of its rule at
    the place it fixed. ``select``/``ignore`` choose the codes as for :func:`lint_source`.

    >>> fix_source("import torch\\nscaler = torch.cuda.amp.GradScaler()\\n").text
    'import torch\\nscaler = torch.amp.GradScaler("cuda")\\n'
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    if not isinstance(filename, str):
        raise TypeError(f"filename must be str, got {type(filename).__name__}")
    options = make_options(select, ignore, torch_version)
    return fix_text(text, filename, options)


def fix_paths(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    write: bool = True,
    select: Codes = None,
    ignore: Codes = None,
    exclude: Iterable[str] = (),
    torch_version: str | None = None,
    project: bool = True,
) -> list[Fixed]:
    """Fix the files under ``paths`` (as :func:`lint_paths` finds them); returns one
    :class:`Fixed` per file that needs fixing. ``write=False`` changes nothing on disk
    (``--diff``).

    A file is written back in its own encoding (a BOM stays) and newline style, through a
    temporary file in its folder, fsync and ``os.replace``, keeping its mode and (where this
    user may) its owner: it is either fully fixed or unchanged. A file that was not written
    has ``Fixed.error`` set, and the others are still fixed: a symlink (never written through:
    it may lead outside ``paths``), a read-only file (no write bit, or a read-only
    filesystem), a full disk, or a file that changed since it was read (size, mtime, inode and
    content hash are checked just before the rename). Files that cannot be read or decoded, or
    whose bytes would not survive a decode and encode unchanged, are skipped
    (:func:`lint_paths` reports the first two as AG200).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if isinstance(exclude, str):
        exclude = [exclude]
    check_bool("write", write)
    check_bool("project", project)
    options = make_options(select, ignore, torch_version)
    files = list(iter_python_files(paths, tuple(exclude)))
    tree = Project(files) if project else None
    out: list[Fixed] = []
    with relaxed_gc():
        for path in files:
            fixed = _fix_one(path, write, options, tree)
            if fixed is not None:
                out.append(fixed)
    return out


def _fix_one(path: str, write: bool, options: Options, tree: Project | None) -> Fixed | None:
    data = read_source(path)
    if isinstance(data, Finding):
        return None
    try:
        snapshot = Snapshot.of(path, data)
        text, encoding = decode(data)
        if text.encode(encoding) != data:
            return None  # the codec would not give the same bytes back: never rewrite it
    except (OSError, SyntaxError, UnicodeError, LookupError):
        return None
    fixed = fix_text(text, path, options, partial(_lint_in, path=path, options=options, tree=tree))
    if not fixed.changed:
        return None
    fixed.encoding = encoding
    try:
        new = fixed.data
    except UnicodeError as err:  # the file's codec cannot hold the fix's text
        fixed.error = f"the fix cannot be written in the file's encoding ({encoding}): {err}"
        return fixed
    # --diff leaves out only what --fix never writes (a link); a read-only file is shown
    fixed.error = replace(path, new, snapshot) if write else link_refusal(path)
    return fixed


def _lint_in(text: str, *, path: str, options: Options, tree: Project | None) -> list[Finding]:
    return lint_bytes(text, path, options, tree)


def lint_paths(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    select: Codes = None,
    ignore: Codes = None,
    exclude: Iterable[str] = (),
    torch_version: str | None = None,
    project: bool = True,
) -> list[Finding]:
    """Lint files and folders (recursing into ``*.py``); returns sorted findings.

    Folders skip :data:`DEFAULT_EXCLUDES` (``.git``, ``.venv``, ``build``, ``site-packages``, ...)
    and the glob patterns in ``exclude``. A missing path raises :class:`FileNotFoundError`; an
    unreadable or unparsable file gives an AG200 finding, and so does anything that is not a
    regular file (a FIFO, a device, a symlink loop) or is larger than :data:`MAX_FILE_BYTES`
    (10 MiB): those are never read. ``project=True`` (project mode) lets a call to a function
    or class defined in another linted file (``from utils import save_checkpoint``) be read
    through that definition; ``False`` lints each file alone.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    for path in paths:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"paths must hold str or os.PathLike items, got {path!r}")
    if isinstance(exclude, str):
        exclude = [exclude]
    check_bool("project", project)
    options = make_options(select, ignore, torch_version)
    findings: list[Finding] = []
    files = list(iter_python_files(paths, tuple(exclude)))
    tree = Project(files) if project else None
    with relaxed_gc():
        for path in files:
            data = read_source(path)  # regular files only, at most MAX_FILE_BYTES
            if isinstance(data, Finding):
                if "AG200" in options.codes:
                    findings.append(data)
                continue
            findings.extend(lint_bytes(data, path, options, tree))
    return sort_findings(findings)
