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

from ampguard.runlog._errors import TelemetryError
from ampguard.runlog._files import read_coverage, read_findings, read_meta
from ampguard.runlog._load import RunLog, last_step_record, load_run, read_json
from ampguard.runlog._lock import RunFolderLock
from ampguard.runlog._log import EventLog, append_findings, json_line, write_json_atomic
from ampguard.runlog._names import (
    COVERAGE,
    EVENTS,
    FINDING_EVENT,
    FINDINGS,
    FLIGHT_RECORDER_DIR,
    FLIGHT_RECORDER_KIND,
    FLIGHT_RECORDER_VERSION,
    META,
    REPORT,
    TB_DIR,
    TRIAGE_DIR,
    TRIAGE_KIND,
    TRIAGE_VERSION,
)
from ampguard.runlog._numbers import floats, num, number_texts
from ampguard.runlog._schema import FP8_FIELDS, RunFolderError

__all__ = [
    "FLIGHT_RECORDER_DIR",
    "FLIGHT_RECORDER_KIND",
    "FLIGHT_RECORDER_VERSION",
    "EVENTS",
    "META",
    "FINDINGS",
    "COVERAGE",
    "REPORT",
    "TB_DIR",
    "TRIAGE_DIR",
    "TRIAGE_KIND",
    "TRIAGE_VERSION",
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
    "FP8_FIELDS",
    "read_coverage",
]
