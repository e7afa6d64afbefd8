"""Reading a file: bytes -> text -> AST, with one AG200 finding for anything that does not parse.

Only regular files are read (:func:`read_source`): a FIFO, a device (``/dev/zero`` behind a
symlink), a socket or a folder named ``x.py`` is an AG200 finding, never a read that blocks or
fills memory; so is a file larger than :data:`MAX_FILE_BYTES`. Also reads ``# noqa`` comments.
"""

from __future__ import annotations

import ast
import errno
import io
import os
import re
import stat
import tokenize
import warnings
from dataclasses import dataclass
from typing import Literal

from ampguard.findings import Finding, make

__all__ = [
    "Parsed",
    "MAX_FILE_BYTES",
    "noqa_codes",
    "parse",
    "physical_lines",
    "read_source",
    "syntax_finding",
]

MAX_FILE_BYTES = 10 * 2**20  # 10 MiB: far above hand-written code, below a generated data dump

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def physical_lines(text: str) -> list[str]:
    """``text`` split into lines as Python's tokenizer counts them (at ``\\n``, ``\\r\\n``
    and ``\\r`` only, ends kept): never ``str.splitlines()``, which also splits at a form feed,
    ``\\x1c``-``\\x1e``, ``\\x85`` and U+2028/U+2029 and so moves every edit after them."""
    return _LINE.findall(text)


_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*))?", re.I)


@dataclass
class Parsed:
    """A parsed file; ``text`` is decoded lazily (only files with findings need it)."""

    path: str
    tree: ast.Module
    data: bytes | None = None
    _text: str | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = _decode(self.data or b"", strict=False)
        return self._text


def syntax_finding(path: str, message: str, line: int | None = 1, col: int | None = 1) -> Finding:
    """The AG200 finding for a file that could not be read or parsed."""
    return make(
        "AG200",
        message,
        fix="fix the syntax or save the file as UTF-8 (or declare its encoding with a coding "
        "comment); the other rules cannot check a file that does not parse",
        path=path,
        line=max(int(line or 1), 1),
        col=max(int(col or 1), 1),
    )


def read_source(path: str) -> bytes | Finding:
    """The bytes of the regular file at ``path``, or the AG200 finding saying why not.

    Opened non-blocking (a FIFO cannot stall the run), checked with ``fstat`` on the open file
    (no race with a rename), read up to :data:`MAX_FILE_BYTES`.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        dangling = _dangling(path) if err.errno == errno.ENOENT else None
        if dangling is not None:
            return syntax_finding(path, dangling)
        return syntax_finding(path, f"cannot read the file: {err.strerror or err}")
    with os.fdopen(fd, "rb", buffering=0) as fh:
        mode, size = os.fstat(fd)[stat.ST_MODE], os.fstat(fd).st_size
        if not stat.S_ISREG(mode):
            return syntax_finding(path, f"not read: {_kind(mode)}, not a regular file")
        if size > MAX_FILE_BYTES:
            return syntax_finding(
                path,
                f"not read: {size:,} bytes, over lint's {MAX_FILE_BYTES:,}-byte cap for one file",
            )
        try:
            data = fh.read(MAX_FILE_BYTES + 1)
        except OSError as err:
            return syntax_finding(path, f"cannot read the file: {err.strerror or err}")
    if data is None or len(data) > MAX_FILE_BYTES:  # it grew while being read
        return syntax_finding(path, f"not read: over lint's {MAX_FILE_BYTES:,}-byte cap")
    return data


def _dangling(path: str) -> str | None:
    """``not read: a dangling symlink to 'target' (...)`` for a symlink whose target is missing."""
    try:
        if not os.path.islink(path):
            return None
        target = os.readlink(path)
    except OSError:
        return None
    if os.path.exists(path):
        return None  # the target is there: the open failed for another reason
    where = os.path.normpath(os.path.join(os.path.dirname(path), target))
    shown = repr(target) if target == where else f"{target!r} ({where})"
    return f"not read: a dangling symlink: it points to {shown}, which does not exist"


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def parse(source: str | bytes, path: str) -> Parsed | Finding:
    """Parse ``source``; returns :class:`Parsed` or the AG200 finding that explains why not.

    Bytes are held to what Python itself accepts: a non-ASCII file must decode in its declared
    encoding (UTF-8 when no coding comment declares one), even where ``ast.parse`` would let
    the bad bytes pass in a comment (a latin-1 file without a cookie: ``python`` refuses it).
    Cost: one decode of a file that is not pure ASCII.
    """
    if isinstance(source, bytes) and not source.isascii():
        bad = _encoding_problem(source, path)
        if bad is not None:
            return bad
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes etc. are not ours to report
            tree = ast.parse(source, filename=path)
    except SyntaxError as err:
        if isinstance(source, bytes):
            bad = _encoding_problem(source, path)
            if bad is not None:
                return bad
        return syntax_finding(path, f"syntax error: {err.msg}", err.lineno, err.offset)
    except ValueError as err:  # null bytes (Python < 3.12)
        return syntax_finding(path, f"cannot parse: {err}")
    except (RecursionError, MemoryError):
        return syntax_finding(path, "cannot parse: the code is nested too deeply")
    if isinstance(source, bytes):
        return Parsed(path, tree, data=source)
    return Parsed(path, tree, _text=source)


def _decode(data: bytes, strict: bool) -> str:
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:
        encoding = "utf-8"
    return data.decode(encoding, "strict" if strict else "replace")


def _encoding_problem(data: bytes, path: str) -> Finding | None:
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as err:  # also raised for non-UTF-8 bytes without a declaration
        if _is_utf8(data):
            return syntax_finding(path, f"cannot read the encoding declaration: {err}")
        encoding = "utf-8"  # the decode below names the first bad byte and its line
    try:
        data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as err:
        start = getattr(err, "start", 0)
        line = len(physical_lines(data[:start].decode("latin-1")))  # the bad byte's line
        if _declared(data):
            return syntax_finding(path, f"file is not valid {encoding}: {err}", line)
        return syntax_finding(
            path,
            f"file is not valid utf-8 and no coding comment declares another encoding "
            f"(Python refuses it): {err}",
            line,
        )
    return None


_COOKIE = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*[-\w.]+", re.M)


def _declared(data: bytes) -> bool:
    """A coding comment on one of the first two lines (PEP 263)."""
    head = b"".join(re.findall(rb"[^\r\n]*(?:\r\n|\r|\n)?", data[:1024])[:2])
    return _COOKIE.search(head) is not None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def noqa_codes(line: str) -> frozenset[str] | None | Literal[False]:
    """Codes a ``# noqa`` on ``line`` silences: ``None`` for all, ``False`` for no comment."""
    if "#" not in line:
        return False
    match = _NOQA.search(line)
    if match is None:
        return False
    codes = match.group("codes")
    if not codes:
        return None
    return frozenset(c.upper() for c in re.split(r"[,\s]+", codes) if c)
