"""The run folder's one writer: its lock, its log, ``meta.json``, ``findings.json`` and the sinks.

A :class:`RunWriter` is the run-folder half of a :class:`~ampguard.Telemetry`: it owns the folder
from :meth:`RunWriter.open` (the folder made, the lock taken, the log started or kept for a
resume) to :meth:`RunWriter.close` / :meth:`RunWriter.release`, and sends every write through
the write-error policy of :mod:`ampguard.telemetry._disk` (``on_write_error``). It never reads
the device or the producer: the Telemetry hands it run-log lines, events and ``meta.json``'s
content. Cost: file writes only, never a device op or a host sync.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from ampguard import runlog
from ampguard._util.stack import user_stacklevel
from ampguard.findings import Finding
from ampguard.runlog import TelemetryError
from ampguard.telemetry._disk import WriteFailures

__all__ = ["RunWriter"]


class RunWriter:
    """The run folder and its log for one Telemetry (see the module docstring).

    State: :attr:`failures` (the write-error policy and its counts), :attr:`lock`, :attr:`log`
    (None until the log starts, and after close), :attr:`pending` (an existing log waits for a
    resume to be continued), :attr:`meta` (``meta.json``'s content, written at start, resume and
    close), :attr:`flush_due` (raise mode: a write waits for the next update) and the findings
    already recorded.
    """

    def __init__(
        self,
        run_dir: Path,
        on_write_error: str,
        *,
        resume: bool,
        tensorboard: bool,
        sinks: Any,
    ) -> None:
        self.run_dir = run_dir
        self.resume = resume
        self.failures = WriteFailures(run_dir, on_write_error)  # ValueError for a bad mode
        self.tensorboard = tensorboard
        if tensorboard:
            from ampguard.telemetry._tensorboard import require_tensorboard

            require_tensorboard()
        self.sinks = tuple(sinks)
        for sink in self.sinks:
            if not all(callable(getattr(sink, m, None)) for m in ("start", "write", "close")):
                raise TypeError(
                    "Telemetry sinks must have start(run_dir, layers), "
                    f"write(records, skip_rate) and close(); got {type(sink).__name__}"
                )
        self.flush_due = False  # raise mode: lines (or a full buffer) wait for before_update()
        self.lock: runlog.RunFolderLock | None = None
        self.log: runlog.EventLog | None = None
        self.pending = False
        self.meta: dict[str, Any] = {}
        self._tb: Any = None  # the TensorBoard sink, once open
        self._recorded: set[str] = set()  # findings already in the run log
        self.final: list[Finding] | None = None  # the findings last written (close's)

    @property
    def events(self) -> Path:
        """The run log's path (``events.jsonl``)."""
        return self.run_dir / runlog.EVENTS

    @property
    def meta_path(self) -> Path:
        """``meta.json``'s path."""
        return self.run_dir / runlog.META

    @property
    def has_sinks(self) -> bool:
        """True when step records also go to TensorBoard or an extra sink."""
        return self._tb is not None or bool(self.sinks)

    # ------------------------------------------------------------------ open
    def open(self, meta: dict[str, Any], layers: list[str]) -> None:
        """Make the folder, take its lock, start the log (or keep an existing one for a resume)
        and start the sinks. A folder that cannot be made or written, or that another writer
        holds, is a :class:`TelemetryError` naming it; nothing stays held then."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TelemetryError(
                f"telemetry run folder {self.run_dir} cannot be created: {exc.strerror or exc}",
                str(self.run_dir),
            ) from exc
        self.lock = runlog.RunFolderLock(self.run_dir)  # TelemetryError if another writer holds it
        try:
            self._open_log(meta, layers)
        except BaseException as exc:
            self.release(abandon=True)
            if isinstance(exc, OSError):
                raise TelemetryError(
                    f"telemetry run folder {self.run_dir} cannot be written: {exc.strerror or exc}",
                    str(self.run_dir),
                ) from exc
            raise

    def _open_log(self, meta: dict[str, Any], layers: list[str]) -> None:
        self.meta = meta
        self.log = None
        # An existing log is continued only if the producer resumes from a checkpoint before
        # its first step (see continue_log); a run that just starts in the folder starts anew.
        self.pending = self.resume and self.events.exists() and self.meta_path.exists()
        if self.pending:
            why = _cannot_continue(self.meta_path, layers)
            if why:
                warnings.warn(
                    f"{self.run_dir}: {why}; starting a new log",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
                self.pending = False
        if not self.pending:
            self._start_log()
        if self.tensorboard:
            from ampguard.telemetry._tensorboard import TensorBoardSink

            self._tb = TensorBoardSink(self.run_dir / runlog.TB_DIR, layers)
        for sink in self.sinks:  # extra sinks
            sink.start(self.run_dir, list(layers))

    def _start_log(self) -> None:
        self.pending = False
        if self.events.exists() and self.events.stat().st_size:
            os.replace(self.events, self.events.with_name(runlog.EVENTS + ".prev"))
        self.log = runlog.EventLog(self.events, fresh=True)
        runlog.write_json_atomic(self.meta_path, self.meta)

    def begin(self) -> None:
        """The first step came without a resume: start a new log (a failure to start it follows
        the policy; the log is then started by the first write that succeeds)."""
        try:
            self._start_log()
        except OSError as exc:
            self.pending = False
            self.failures.failed(self.events, exc)

    def continue_log(self, step: int) -> int:
        """A resume: continue the pending log (if one waits) and return the step count to go on
        from (``step``; for ``step == 0``, the last step of a continued log)."""
        if self.pending:
            self.pending = False
            self.meta = runlog.read_meta(self.meta_path)
            self.log = runlog.EventLog(self.events, fresh=False)
            if step == 0:
                last = runlog.last_step_record(self.events)
                step = int(last["step"]) if last else 0
        return step

    # ------------------------------------------------------------------ writes (the policy)
    def write(self, lines: list[str], steps: tuple[int, ...] = (), events: int = 0) -> bool:
        """Append run-log ``lines`` (the records of ``steps``, or ``events`` other lines) under
        the write-error policy; True when written."""
        written = self.failures.write(self._open_events, self.events, lines, steps, events)
        if self.failures.unwritten:  # raise mode: retried before the next update
            self.flush_due = True
        return written

    def _open_events(self) -> runlog.EventLog:
        if self.log is None:  # the new log's start failed on a full disk: start it now
            self._start_log()
        assert self.log is not None
        return self.log

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append non-step records (no error raised here: see :meth:`raise_error`)."""
        self.write([runlog.json_line(r) for r in records], events=len(records))

    def append_events(self, records: list[dict[str, Any]]) -> None:
        """Append ``records`` once the log has started, then raise a kept write error."""
        if self.log is not None:
            self.append(records)
            self.raise_error()

    def to_sinks(self, lines: list[str], rates: Any) -> None:
        """Send written step ``lines`` to TensorBoard, then the extra sinks; a sink's failed
        write follows the same policy."""
        records = [json.loads(line) for line in lines]
        for sink in (self._tb, *self.sinks):
            if sink is None:
                continue
            try:
                sink.write(records, rates)
            except OSError as exc:  # tb/ on the same full disk: the same policy
                where = self.run_dir / runlog.TB_DIR if sink is self._tb else self.run_dir
                self.failures.failed(where, exc)

    def retry(self) -> None:
        """Write what failed before (raise mode's lines, warn mode's gap line), if anything."""
        if self.failures.retry_due:
            self.write([])

    def write_json(self, path: Path, obj: Any) -> bool:
        """Replace a JSON file of the run folder atomically under the policy."""
        return self.failures.write_json(path, obj)

    def raise_error(self) -> None:
        """Raise mode: raise the kept :class:`TelemetryError` (once); no-op otherwise."""
        self.failures.raise_pending()

    def mark_resume(self, step: int, scale: float, scale_reset: bool) -> Any:
        """Write the resume at ``step`` (with the ``scale`` it continues with) to the log and to
        ``meta.json``'s ``resumes``; return the scale the log recorded after the last step up
        to ``step`` (None if none)."""
        assert self.log is not None
        before = runlog.last_step_record(self.events, at_most=step)
        previous = before.get("scale") if before else None
        event = {
            "kind": "resume",
            "step": step,
            "scale": runlog.num(scale),
            "previous_scale": previous,
            "scale_reset": scale_reset,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.append([event])
        self.meta.setdefault("resumes", []).append(event)
        self.write_json(self.meta_path, self.meta)
        self.raise_error()
        return previous

    def unrecorded(self) -> dict[str, Any]:
        """What the disk kept out of the run log, and whether writes are suspended."""
        return {**self.failures.summary(), "suspended": self.failures.suspended}

    # ------------------------------------------------------------------ findings
    def fresh(self, found: list[Finding]) -> list[Finding]:
        """The findings of ``found`` not yet recorded."""
        return [f for f in found if repr(f.to_dict()) not in self._recorded]

    def record_findings(self, fresh: list[Finding]) -> None:
        """Record findings made during the run in the log (once the log has started)."""
        if self.log is not None:
            self.append(
                [
                    {"kind": runlog.FINDING_EVENT, "step": f.step, "finding": f.to_dict()}
                    for f in fresh
                ]
            )
            self.raise_error()
            self._recorded.update(repr(f.to_dict()) for f in fresh)

    def findings(self) -> list[Finding]:
        """Evaluate the AG1xx rules over the whole log and write ``findings.json`` (none before
        the log has started). Cost: a read of the run log."""
        from ampguard import rules

        if self.log is None:  # nothing recorded yet
            return []
        try:
            self.log.sync()
        except OSError as exc:  # EIO on a failing disk
            self.failures.failed(self.events, exc)
        found = rules.evaluate(runlog.load_run(self.run_dir))
        self.final = list(found)
        self.write_json(self.run_dir / runlog.FINDINGS, [f.to_dict() for f in found])
        self.raise_error()
        return found

    def final_findings(self) -> list[Finding]:
        """After close: the findings close wrote, else ``findings.json`` as written ([] when it
        never was). Cost: none, or one read of ``findings.json``."""
        if self.final is not None:
            return list(self.final)
        try:
            data = json.loads((self.run_dir / runlog.FINDINGS).read_text(encoding="utf-8"))
            return [Finding.from_dict(d) for d in data]
        except (OSError, ValueError, TypeError, KeyError):
            return []

    # ------------------------------------------------------------------ close and release
    def close(self, error: TelemetryError | None) -> TelemetryError | None:
        """Close the sinks and the log, write ``meta.json``'s end and release the folder; return
        the error to raise: ``error``, else the policy's kept one (raise mode), else None."""
        try:
            if self._tb is not None:
                self._tb.close()
            for sink in self.sinks:  # extra sinks
                sink.close()
            if self.log is not None:
                try:
                    self.log.close()
                except OSError as exc:
                    self.log = None
                    self.failures.failed(self.events, exc)
                self.meta["end_time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                if self.failures.gaps or self.failures.lost_events:
                    self.meta["unrecorded"] = self.failures.summary()
                self.write_json(self.meta_path, self.meta)
        finally:
            self.release(abandon=False)
        if error is None:
            error, self.failures.pending_error = self.failures.pending_error, None
        return error

    def release(self, *, abandon: bool) -> None:
        """Give the folder up without writing more: the log file closed (``abandon``: without
        its final sync) and the lock released. Idempotent; never raises."""
        log, self.log = self.log, None
        if log is not None and abandon:
            log.abandon()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _cannot_continue(meta_path: Path, layers: list[str]) -> str | None:
    """Why the run log in the folder cannot be continued by this model, or None."""
    try:
        meta = runlog.read_meta(meta_path)
    except runlog.RunFolderError as exc:
        return f"the existing run log cannot be continued ({exc})"
    if (meta.get("layers") or {}).get("names") != layers:
        return "the existing run log was written for a model with other layers"
    return None
