"""The run folder on disk: write it crash-safely, read it back tolerantly.

Layout of ``RUN_DIR``: ``events.jsonl`` (one JSON object per line: a step record, or an event such
as ``{"kind": "resume", ...}``), ``meta.json`` (model summary, configs, versions, start time),
``findings.json``, ``report.html`` and ``tb/`` (TensorBoard, optional).

Writes never leave a half-written file behind: JSON files are replaced atomically (temporary file,
fsync, rename) and the event log is only ever appended whole lines at a time. A process killed in
the middle of an append can leave a torn last line; :func:`load_run` skips it with a warning and a
writer that continues the log cuts it off first; a write that fails (a full or read-only disk)
is cut back to the last whole line. A folder has one writer at a time (:class:`RunFolderLock`,
the lock file ``.ampguard.lock``); a folder that cannot be written or is held is a
:class:`TelemetryError` naming it. What every file may hold (record kinds, fields,
types) is :mod:`ampguard.runlog._schema`; every reader goes through it, so a malformed line is a
warning naming file, line and field, and an unusable ``meta.json`` is a :class:`RunFolderError`
naming the file. This module imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ampguard._util import atomic
from ampguard._util.stack import user_stacklevel
from ampguard.runlog._errors import TelemetryError
from ampguard.runlog._files import read_findings, read_json_file, read_meta
from ampguard.runlog._lock import RunFolderLock
from ampguard.runlog._read import read_columns
from ampguard.runlog._schema import RunFolderError, check_record, parse_line

__all__ = [
    "EVENTS",
    "META",
    "FINDINGS",
    "COVERAGE",
    "REPORT",
    "TB_DIR",
    "EventLog",
    "json_line",
    "FINDING_EVENT",
    "append_findings",
    "RunLog",
    "load_run",
    "write_json_atomic",
    "read_json",
    "floats",
    "num",
    "number_texts",
    "last_step_record",
    "RunFolderError",
    "TelemetryError",
    "RunFolderLock",
    "read_meta",
    "read_findings",
]

EVENTS = "events.jsonl"
META = "meta.json"
FINDINGS = "findings.json"
COVERAGE = "coverage.json"  # Guard(coverage_step=N): the autocast census of that step
REPORT = "report.html"
TB_DIR = "tb"
FINDING_EVENT = "finding"  # events.jsonl line kind: {"kind": "finding", "step", "finding": {...}}


def num(value: Any) -> float | None:
    """A JSON-safe float (7 significant digits) or ``None`` for non-finite values."""
    x = float(value)
    return float(f"{x:.7g}") if math.isfinite(x) else None


def floats(values: Any) -> list[float | None]:
    """A JSON-safe list of floats (7 significant digits, ``None`` for non-finite)."""
    isfinite = math.isfinite
    return [
        float(f"{x:.7g}") if isfinite(x) else None
        for x in np.asarray(values, dtype=np.float64).ravel().tolist()
    ]


def number_texts(values: Any) -> list[str]:
    """The JSON text :func:`num` gives each value (``"null"`` for non-finite ones), without
    building a float or a dict per value: the run-log writer formats whole columns with it
    (a value that repeats, such as the loss scale, is formatted once)."""
    known: dict[float, str] = {}
    out = []
    if isinstance(values, np.ndarray):
        values = values.ravel().tolist()
    elif not isinstance(values, list):
        values = np.asarray(values, dtype=np.float64).ravel().tolist()
    for x in values:
        text = known.get(x)
        if text is None:
            if x - x == 0.0:  # finite
                text = f"{x:.7g}"
                if "." not in text and "e" not in text:
                    text += ".0"
            else:  # NaN never matches itself in ``known``; inf is cached like any value
                text = "null"
            known[x] = text
        out.append(text)
    return out


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (temporary file, fsync, rename)."""
    atomic.write_text(path, json.dumps(obj, indent=1, allow_nan=False, default=str))


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; :class:`RunFolderError` (a ``ValueError``) naming the file when it is
    not valid JSON, is a folder or cannot be read."""
    return read_json_file(path)


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


def last_step_record(path: str | os.PathLike, at_most: int | None = None) -> dict[str, Any] | None:
    """The last complete step record of an event log (reads from the end), or ``None``.

    With ``at_most``, the last one whose step is ``<= at_most``.
    """
    path = Path(path)
    if not path.exists():
        return None
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        block = 65536
        while True:
            start = max(0, size - block)
            fh.seek(start)
            lines = fh.read(size - start).split(b"\n")
            for line in reversed(lines[1:] if start > 0 else lines):  # lines[0] may be partial
                rec = _parse(line)
                if (
                    rec is not None
                    and rec.get("kind", "step") == "step"
                    and check_record(rec, _width(rec)) is None
                    and (at_most is None or rec["step"] <= at_most)
                ):
                    return rec
            if start == 0:
                return None
            block *= 4


def _width(rec: dict[str, Any]) -> int:
    """The layer count a step record claims (the schema then checks every list has it)."""
    for group, key in (("layers", "grad_norm"), ("range", "amax")):
        holder = rec.get(group)
        values = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(values, list):
            return len(values)
    return 0


def _parse(line: bytes) -> dict[str, Any] | None:
    rec = parse_line(line)
    return None if isinstance(rec, str) else rec


@dataclass
class RunLog:
    """A run folder read back: metadata, per-step arrays, per-layer and range samples, events.

    Arrays are aligned per family: ``steps`` with ``scale``/``applied``/...; ``layer_steps`` with
    ``layer_norm`` (shape samples x layers); ``range_steps`` with ``zero_frac`` and the other
    range figures.
    Missing values are NaN. Steps superseded by a resume (re-run after a checkpoint) are dropped.
    """

    run_dir: Path
    meta: dict[str, Any]
    layers: list[str]
    steps: np.ndarray
    scale_before: np.ndarray
    scale: np.ndarray
    applied: np.ndarray
    overflow: np.ndarray
    collapse: np.ndarray
    dropped: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray
    precision: list[str]
    layer_steps: np.ndarray
    layer_applied: np.ndarray
    layer_norm: np.ndarray
    range_steps: np.ndarray
    range_applied: np.ndarray
    range_scale: np.ndarray
    range_precision: list[str]
    zero_frac: np.ndarray
    amax: np.ndarray
    headroom_bits: np.ndarray
    underflow: np.ndarray
    safe_lo: np.ndarray
    safe_hi: np.ndarray
    window: np.ndarray  # (R, 2): global safe scale window per range sample
    events: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0
    # non-finite gradients without a loss scaler (skipped, or applied by a watched framework)
    nonfinite: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    loss_nonfinite: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def resumes(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") == "resume"]

    @property
    def fallbacks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") == "fallback"]

    @property
    def unrecorded(self) -> list[dict[str, Any]]:
        """Ranges of steps a failed write (a full or read-only disk) kept out of the log:
        ``{"step": first, "last", "records", "reason", ...}``, from the log's ``unrecorded``
        lines and ``meta.json["unrecorded"]`` (a gap the disk never had room for again)."""
        gaps = [e for e in self.events if e.get("kind") == "unrecorded"]
        seen = {g["step"] for g in gaps}
        meta = self.meta.get("unrecorded")
        extra = meta.get("gaps") if isinstance(meta, dict) else None
        for g in extra if isinstance(extra, list) else []:
            if (
                isinstance(g, dict)
                and type(g.get("step")) is int
                and type(g.get("last")) is int
                and g["step"] not in seen
            ):
                gaps.append(g)
        return sorted(gaps, key=lambda g: g["step"])

    def scaler_config(self) -> dict[str, Any]:
        return dict(self.meta.get("scaler") or {})


def load_run(run_dir: str | os.PathLike) -> RunLog:
    """Read a run folder written by :class:`ampguard.Telemetry` (streamed, one pass).

    Raises :class:`RunFolderError` (a ``ValueError``) naming the file when ``run_dir`` has no
    ``meta.json``/``events.jsonl`` or one of them cannot be used. A line of the log that does not
    follow the schema (:mod:`ampguard.runlog._schema`; a torn last line after a crash, a field of
    the wrong type) is skipped with a ``RuntimeWarning`` naming the line and the field.
    """
    run_dir = Path(run_dir)
    meta_path, events_path = run_dir / META, run_dir / EVENTS
    if not run_dir.exists():
        raise RunFolderError(f"run_dir {str(run_dir)!r} does not exist")
    if not run_dir.is_dir():
        raise RunFolderError(f"run_dir {str(run_dir)!r} is not a folder (a run folder is)")
    if not meta_path.exists() or not events_path.exists():
        raise RunFolderError(
            f"run_dir {str(run_dir)!r} is not an ampguard run folder (needs "
            f"{META} and {EVENTS}, written by ampguard.Telemetry)"
        )
    meta = read_meta(meta_path)
    layers = list((meta.get("layers") or {}).get("names") or [])
    cols = read_columns(events_path, len(layers), failed_writes=bool(meta.get("unrecorded")))
    return RunLog(run_dir=run_dir, meta=meta, layers=layers, **cols)


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
