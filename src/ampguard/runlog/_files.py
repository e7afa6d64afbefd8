"""Opening the run folder's files: regular files only, every failure one error naming the file.

The shape of what is inside is :mod:`ampguard.runlog._schema`; this module reads and applies it.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ampguard._util.stack import user_stacklevel
from ampguard.runlog._schema import (
    LineWarnings,
    RunFolderError,
    check_finding,
    check_meta,
    coverage_ok,
)

__all__ = [
    "iter_lines",
    "open_regular",
    "read_json_file",
    "read_meta",
    "read_findings",
    "read_coverage",
]


def iter_lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """``(line number, line, complete)`` for every non-blank line of ``path``, streamed.

    ``complete`` is False for a last line without its newline (a writer killed mid-append).
    Raises :class:`RunFolderError` when the file cannot be opened as a regular file.
    """
    fh = open_regular(path)
    with fh:
        for number, line in enumerate(fh, start=1):
            complete = line.endswith(b"\n")
            if line.strip():
                yield number, line, complete


def open_regular(path: str | os.PathLike, buffering: int = 1 << 20) -> Any:
    """``path`` opened for reading in binary mode, if it is a regular file.

    Opened non-blocking (as lint's sources are: a FIFO in place of the file must not stall the
    reader until some writer opens it) and checked with ``fstat`` on the open descriptor (no race
    with a rename); anything else is a :class:`RunFolderError` naming the file and what it is.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise RunFolderError(f"{path} is a folder, not a file") from None
    except OSError as exc:
        raise RunFolderError(f"cannot read {path}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise RunFolderError(f"{path} is {_kind(mode)}, not a regular file; not read")
    if flags & getattr(os, "O_NONBLOCK", 0):  # reads of a regular file: back to blocking
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=buffering)


def _kind(mode: int) -> str:
    for check, what in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if check(mode):
            return what
    return "not a regular file"


def read_json_file(path: str | os.PathLike) -> Any:
    """Parse a JSON file; :class:`RunFolderError` naming it when it cannot be used (also when it
    is a FIFO or device: checked without blocking)."""
    path = Path(path)
    if path.is_dir():
        raise RunFolderError(f"{path} is a folder, not a JSON file")
    try:
        with open_regular(path, buffering=-1) as fh:
            return json.loads(fh.read())
    except RunFolderError:
        raise
    except OSError as exc:
        raise RunFolderError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RunFolderError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise RunFolderError(f"{path} is not usable JSON: nested too deeply") from None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``meta.json`` checked against :data:`META_FIELDS`: a wrong field is dropped, warned."""
    meta = read_json_file(path)
    if type(meta) is not dict:
        raise RunFolderError(
            f"{path} must hold a JSON object (the run's metadata), got a JSON {type(meta).__name__}"
        )
    note = LineWarnings(path)
    check_meta(meta, note)
    note.close()
    return meta


def read_findings(path: str | os.PathLike) -> list[dict[str, Any]]:
    """``findings.json``: a list of finding dicts; :class:`RunFolderError` naming the file and
    the entry when it is not."""
    data = read_json_file(path)
    if type(data) is not list:
        raise RunFolderError(
            f"{path} must hold a JSON list of findings, got a JSON {type(data).__name__}"
        )
    for i, item in enumerate(data):
        bad = check_finding(item)
        if bad is not None:
            raise RunFolderError(f"{path}: entry {i}: {bad}")
    return data


def read_coverage(path: str | os.PathLike) -> dict[str, Any] | None:
    """``coverage.json`` for the report, or ``None`` (with a warning) when it is unusable."""
    try:
        cov = read_json_file(path)
    except RunFolderError as exc:
        warnings.warn(
            f"{exc}; the coverage section is left out", RuntimeWarning, stacklevel=user_stacklevel()
        )
        return None
    ok = coverage_ok(cov)
    if not ok:
        warnings.warn(
            f"{path}: not an autocast census written by ampguard; the coverage section is left out",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return None
    return cov
