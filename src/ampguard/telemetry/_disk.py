"""What telemetry does when the run folder cannot be written (a full or read-only disk).

Training never depends on the run log. :class:`WriteFailures` is the policy a
:class:`~ampguard.Telemetry` applies to every failed write (``OSError``: ``ENOSPC``, ``EDQUOT``,
``EROFS``, ``EIO``...), chosen with ``Telemetry(on_write_error=...)``:

- ``"warn"`` (the default): telemetry is *suspended*: one ``RuntimeWarning`` names the file and
  the OS error, training goes on, and the records that cannot be written are counted (their
  steps, first to last). Every later flush tries again; the first write that succeeds starts
  with an ``{"kind": "unrecorded", "step": N, "last": M, "records": k, "reason": "disk full",
  ...}`` line, so the report says "steps N-M not recorded (disk full)" instead of counting a
  gap as steps that were fine. The gaps are also kept in ``meta.json`` (``"unrecorded"``) when
  it can be written at close.
- ``"raise"``: a :class:`~ampguard.TelemetryError` naming the file (the ``OSError`` as its
  cause). The Guard writes a full buffer of records at the start of the next window's
  ``step()``, before anything of that window is applied, so the error comes before the update
  and the window can be stepped again once there is space; records that failed are kept and
  written first then (nothing is lost). A flush inside ``Guard.state_dict()`` (a checkpoint)
  never raises: the error comes at the next ``step()``, ``flush()`` or ``close()``, and the
  checkpoint is written.

A failed write never leaves a partial line (:class:`ampguard.runlog.EventLog` cuts it back).
Cost: nothing while writes succeed (one attribute test per flush).
"""

from __future__ import annotations

import errno
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampguard import runlog
from ampguard.runlog import TelemetryError

__all__ = ["ON_WRITE_ERROR", "WriteFailures", "reason_of"]

ON_WRITE_ERROR = ("warn", "raise")
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def reason_of(exc: OSError) -> str:
    """A short cause for the report: "disk full", "read-only file system", or the OS text."""
    if exc.errno in _FULL:
        return "disk full"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    return (exc.strerror or type(exc).__name__).lower()


class WriteFailures:
    """The write-failure policy of one Telemetry (see the module docstring) and its counts."""

    def __init__(self, run_dir: Path, mode: str) -> None:
        if mode not in ON_WRITE_ERROR:
            raise ValueError(
                f"Telemetry on_write_error must be one of {ON_WRITE_ERROR}, got {mode!r}"
            )
        self.run_dir = run_dir
        self.mode = mode
        self.unwritten: list[str] = []  # raise mode: lines whose write failed, written first
        self.pending_error: TelemetryError | None = None  # raise mode: what raise_pending raises
        self.error: OSError | None = None  # the failure telemetry is suspended on, if any
        self.gaps: list[dict[str, Any]] = []  # every range of steps not recorded, in order
        self.lost_records = 0  # step records not written, in all
        self.lost_events = 0  # other lines (resume, fallback, finding, fp8) not written
        self._open: dict[str, Any] | None = None  # the gap in progress (not yet in the log)

    @property
    def suspended(self) -> bool:
        """True while writes fail (warn mode): records are counted, not written."""
        return self.error is not None

    # ------------------------------------------------------------------ the writes
    def write(
        self,
        log: Callable[[], runlog.EventLog],
        path: Path,
        lines: list[str],
        steps: tuple[int, ...] = (),
        events: int = 0,
    ) -> bool:
        """Append ``lines`` (the records of ``steps``, or ``events`` other lines) to the log at
        ``path`` that ``log()`` returns (opening it if need be), all or none; True when
        written. Warn mode: a pending gap line goes first; raise mode: the lines that failed
        before go first, and a failure keeps these too and waits in :attr:`pending_error` for
        :meth:`raise_pending`."""
        gap = [runlog.json_line(g) for g in self.pending_gap()]
        try:
            log().write_lines([*gap, *self.unwritten, *lines])
        except OSError as exc:
            if self.mode == "raise":
                self.unwritten += lines
            self.failed(path, exc, steps, events)
            return False
        self.unwritten = []
        self.written()
        return True

    def write_json(self, path: Path, obj: Any) -> bool:
        """Replace a JSON file of the run folder atomically under the policy; True if written."""
        try:
            runlog.write_json_atomic(path, obj)
        except OSError as exc:
            self.failed(path, exc)
            return False
        return True

    def raise_pending(self) -> None:
        """Raise mode: raise the failure :meth:`failed` kept (once); no-op otherwise."""
        error, self.pending_error = self.pending_error, None
        if error is not None:
            raise error

    def failed(
        self, path: Path, exc: OSError, steps: tuple[int, ...] = (), events: int = 0
    ) -> None:
        """A write to ``path`` failed with ``exc``; it held the records of ``steps`` (and
        ``events`` other lines). Raise mode: keep the :class:`TelemetryError` for
        :meth:`raise_pending` (the first one wins); warn mode: suspend (one warning per
        suspension) and count."""
        if self.mode == "raise":
            self.pending_error = self.pending_error or self.as_error(path, exc)
            return
        if self.error is None:
            warnings.warn(
                f"ampguard telemetry: cannot write {path} ({reason_of(exc)}: {exc}); telemetry "
                "is suspended: training goes on, the records that cannot be written are "
                "counted and each flush tries again (Telemetry(on_write_error='raise') stops "
                "instead)",
                RuntimeWarning,
                stacklevel=2,
            )
        self.error = exc
        self.lost_events += events
        if not steps:
            return
        self.lost_records += len(steps)
        gap = self._open
        if gap is None:
            gap = self._open = {
                "kind": "unrecorded",
                "step": int(steps[0]),
                "last": int(steps[-1]),
                "records": 0,
                "reason": reason_of(exc),
                "error": str(exc),
                "file": path.name,
            }
            self.gaps.append(gap)
        gap["last"] = max(gap["last"], int(steps[-1]))
        gap["records"] += len(steps)

    def as_error(self, path: Path, exc: OSError) -> TelemetryError:
        """The :class:`TelemetryError` for a failed write to ``path`` (``exc`` as the cause)."""
        err = TelemetryError(
            f"ampguard telemetry: cannot write {path} ({reason_of(exc)}: {exc}); the run log "
            "stops here (Telemetry(on_write_error='warn') would suspend it and go on)",
            str(path),
        )
        err.__cause__ = exc
        return err

    @property
    def retry_due(self) -> bool:
        """True while something that failed waits to be written: lines kept in raise mode, or
        the gap line of warn mode (so a flush with no new records still records the gap)."""
        return bool(self.unwritten) or self._open is not None

    def pending_gap(self) -> list[dict[str, Any]]:
        """The gap line to write before the next records (empty when there is none)."""
        return [dict(self._open)] if self._open is not None else []

    def written(self) -> None:
        """A write succeeded: the gap it started with is in the log; telemetry writes again."""
        self._open = None
        self.error = None

    def summary(self) -> dict[str, Any]:
        """JSON-ready counts for ``meta.json`` (``"unrecorded"``)."""
        return {
            "gaps": [dict(g) for g in self.gaps],
            "records": self.lost_records,
            "events": self.lost_events,
        }
