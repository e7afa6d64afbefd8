"""Writing a run folder: the append-only event log and atomically replaced JSON files.

:class:`EventLog` appends whole lines only; a write that fails is cut back to the last whole
line, and a log continued after a crash has its torn last line cut off first (with a warning).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from ampguard._util import atomic
from ampguard._util.stack import user_stacklevel
from ampguard.runlog._names import EVENTS, FINDING_EVENT

__all__ = ["EventLog", "append_findings", "json_line", "write_json_atomic"]


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (temporary file, fsync, rename)."""
    atomic.write_text(path, json.dumps(obj, indent=1, allow_nan=False, default=str))


def json_line(record: dict[str, Any]) -> str:
    """One run-log line: compact JSON (no NaN: those are ``null``) and a newline."""
    return json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"


class EventLog:
    """Append-only JSON-lines file; every :meth:`append` is one ``write`` of whole lines.

    A write that fails (``ENOSPC`` on a full disk, ``EROFS``, ``EIO``) is cut back to the size
    the file had before it, so a failed write never leaves a partial line; the ``OSError``
    propagates. If even the cut fails, the next write starts on a new line (the fragment stays
    a line of its own, which the reader skips) and :attr:`torn` says so until then.
    """

    def __init__(self, path: str | os.PathLike, *, fresh: bool) -> None:
        self.path = Path(path)
        if fresh:
            self.path.write_bytes(b"")
        elif self.path.exists():
            _cut_torn_tail(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.torn = False  # a failed write left a fragment that could not be cut off

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append ``records`` as lines in a single write (atomic position with ``O_APPEND``)."""
        self.write_lines([json_line(r) for r in records])

    def write_lines(self, lines: list[str]) -> None:
        """Append already-encoded JSON lines (each ending in a newline) in a single write;
        all of them or none (see the class docstring)."""
        if not lines:
            return
        fd = self._fd
        if fd is None:
            raise ValueError(f"event log {self.path} is closed")
        text = "".join(lines)
        if self.torn:
            text = "\n" + text
        view = memoryview(text.encode())
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:
                self.torn = os.lseek(fd, 0, os.SEEK_END) > start
            raise
        self.torn = False

    def sync(self) -> None:
        """fsync the log (survives power loss, not only a killed process)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """fsync and close; the file is closed even when the fsync fails (its error raised)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def abandon(self) -> None:
        """Close without an fsync, ignoring errors (a writer that gives the folder up)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _cut_torn_tail(path: Path) -> None:
    with open(path, "rb+") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        if size == 0:
            return
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        keep = _last_newline(fh, size)
        warnings.warn(
            f"{path}: cutting a torn last line ({size - keep} bytes) left by a crash "
            "before continuing the run log",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        fh.truncate(keep)


def _last_newline(fh: Any, size: int) -> int:
    pos = size
    while pos > 0:
        start = max(0, pos - 65536)
        fh.seek(start)
        chunk = fh.read(pos - start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def append_findings(run_dir: str | os.PathLike, found: list[Any]) -> None:
    """Append findings to the run's event log as ``finding`` events (whole lines, atomic).

    For findings made during the run rather than by the rules over the log (forensics,
    distributed, attach mode): ``rules.evaluate`` reads them back (the last event per code and
    title wins), so ``findings.json``, ``ag.report`` and ``ampguard report`` all show them.
    """
    path = Path(run_dir) / EVENTS
    if not found or not path.exists():
        return
    log = EventLog(path, fresh=False)
    try:
        log.append([{"kind": FINDING_EVENT, "step": f.step, "finding": f.to_dict()} for f in found])
    finally:
        log.close()
