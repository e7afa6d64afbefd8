"""``ampguard lint --diff``: a unified diff that ``patch -p1`` and ``git apply`` apply as it is.

The diff is made from the file's bytes, split where ``patch`` and ``git`` split lines (at
``\\n`` only), so that applying it gives exactly the bytes ``--fix`` writes:

- a last line without a newline is followed by ``\\ No newline at end of file``;
- a BOM, CRLF or lone-CR newlines and a non-UTF-8 encoding declared by a coding comment are
  carried as the file's own bytes (a lone-CR file is one line to ``patch``: its hunk is the
  whole file);
- names are relative to ``root`` (the current folder by default: where ``patch -p1`` runs), a
  file outside it is named from the filesystem root (``a/srv/x.py``: ``patch -p1 -d /``), never
  ``a//srv/x.py``; a name with a space ends with a tab and one with a quote, a backslash or a
  control character is C-quoted, as ``git diff`` writes them.
"""

from __future__ import annotations

import difflib
import os

from ampguard.lint._fix import Fixed

__all__ = ["CONTEXT", "unified_diff", "unified_diff_bytes"]

CONTEXT = 3  # lines of context around each change, as diff -u
_NO_NEWLINE = b"\n\\ No newline at end of file\n"
_ESCAPES = {ord('"'): '\\"', ord("\\"): "\\\\", ord("\t"): "\\t", ord("\n"): "\\n"}


def unified_diff_bytes(fixed: Fixed, root: str | os.PathLike | None = None) -> bytes:
    """The ``--- a/path`` / ``+++ b/path`` diff of one fixed file, in the file's own bytes
    (``b''`` when unchanged); ``root``: the folder the names are relative to (default: the
    current one). What ``ampguard lint --diff`` writes."""
    if not fixed.changed:
        return b""
    old, new = _lines(fixed.original_data), _lines(fixed.data)
    name = _name(fixed.path, root)
    out = [b"--- " + _header("a/" + name) + b"\n", b"+++ " + _header("b/" + name) + b"\n"]
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for group in matcher.get_grouped_opcodes(CONTEXT):
        first, last = group[0], group[-1]
        out.append(
            b"@@ -%s +%s @@\n"
            % (_range(first[1], last[2]).encode(), _range(first[3], last[4]).encode())
        )
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out.extend(_line(b" ", line) for line in old[i1:i2])
                continue
            out.extend(_line(b"-", line) for line in old[i1:i2])
            out.extend(_line(b"+", line) for line in new[j1:j2])
    return b"".join(out)


def unified_diff(fixed: Fixed, root: str | os.PathLike | None = None) -> str:
    """:func:`unified_diff_bytes` as text (the file's encoding; bytes it cannot decode are kept
    as surrogate escapes, so ``.encode(encoding, "surrogateescape")`` gives the bytes back)."""
    codec = "utf-8" if fixed.encoding.replace("_", "-").lower() == "utf-8-sig" else fixed.encoding
    return unified_diff_bytes(fixed, root).decode(codec, "surrogateescape")


def _lines(data: bytes) -> list[bytes]:
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _line(mark: bytes, line: bytes) -> bytes:
    if line.endswith(b"\n"):
        return mark + line
    return mark + line + _NO_NEWLINE


def _range(start: int, stop: int) -> str:
    """``start,length`` as diff -u writes it (1-based; an empty range names the line before)."""
    length = stop - start
    begin = start + 1
    if length == 1:
        return f"{begin}"
    if not length:
        begin -= 1
    return f"{begin},{length}"


def _name(path: str, root: str | os.PathLike | None) -> str:
    absolute = os.path.abspath(path)
    base = os.path.abspath(os.fspath(root) if root is not None else os.curdir)
    rel = os.path.relpath(absolute, base)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        rel = absolute.lstrip(os.sep)  # outside the folder: named from the root
    return rel.replace(os.sep, "/")


def _header(name: str) -> bytes:
    if any(ch in name for ch in '"\\') or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        quoted = "".join(
            _ESCAPES.get(ord(ch), ch if ord(ch) >= 0x20 and ord(ch) != 0x7F else f"\\{ord(ch):03o}")
            for ch in name
        )
        return b'"' + os.fsencode(quoted) + b'"'
    raw = os.fsencode(name)
    return raw + b"\t" if b" " in raw else raw
