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

__all__ = ["iter_lines", "read_json_file", "read_meta", "read_findings", "read_coverage"]


def iter_lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """``(line number, line, complete)`` for every non-blank line of ``path``, streamed.

    ``complete`` is False for a last line without its newline (a writer killed mid-append).
    Raises :class:`RunFolderError` when the file cannot be opened as a regular file.
    """
    fh = _open_regular(path)
    with fh:
        for number, line in enumerate(fh, start=1):
            complete = line.endswith(b"\n")
            if line.strip():
                yield number, line, complete


def _open_regular(path: Path) -> Any:
    try:
        fh = open(path, "rb", buffering=1 << 20)  # noqa: SIM115 - closed by the caller
    except IsADirectoryError:
        raise RunFolderError(f"{path} is a folder, not a file") from None
    except OSError as exc:
        raise RunFolderError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not _is_regular(fh):
        fh.close()
        raise RunFolderError(f"{path} is not a regular file")
    return fh


def _is_regular(fh: Any) -> bool:
    return stat.S_ISREG(os.fstat(fh.fileno()).st_mode)


def read_json_file(path: str | os.PathLike) -> Any:
    """Parse a JSON file; :class:`RunFolderError` naming it when it cannot be used."""
    path = Path(path)
    if path.is_dir():
        raise RunFolderError(f"{path} is a folder, not a JSON file")
    try:
        with open(path, "rb") as fh:
            if not _is_regular(fh):
                raise RunFolderError(f"{path} is not a regular file")
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
