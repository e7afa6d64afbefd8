"""The run folder on disk: write it crash-safely, read it back tolerantly.

Layout of ``RUN_DIR``: ``events.jsonl`` (one JSON object per line: a step record, or an event such
as ``{"kind": "resume", ...}``), ``meta.json`` (model summary, configs, versions, start time),
``findings.json``, ``report.html`` and ``tb/`` (TensorBoard, optional).

Writes never leave a half-written file behind: JSON files are replaced atomically (temporary file,
fsync, rename) and the event log is only ever appended whole lines at a time. A process killed in
the middle of an append can leave a torn last line; :func:`load_run` skips it with a warning and a
writer that continues the log cuts it off first. This module imports no torch.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EVENTS",
    "META",
    "FINDINGS",
    "COVERAGE",
    "REPORT",
    "TB_DIR",
    "EventLog",
    "FINDING_EVENT",
    "append_findings",
    "RunLog",
    "load_run",
    "write_json_atomic",
    "read_json",
    "floats",
    "num",
    "last_step_record",
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
    return [float(f"{x:.7g}") if isfinite(x) else None
            for x in np.asarray(values, dtype=np.float64).ravel().tolist()]


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (temporary file, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(obj, indent=1, allow_nan=False, default=str)
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; ``ValueError`` naming the file when it is not valid JSON."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


class EventLog:
    """Append-only JSON-lines file; every :meth:`append` is one ``write`` of whole lines."""

    def __init__(self, path: str | os.PathLike, *, fresh: bool) -> None:
        self.path = Path(path)
        if fresh:
            self.path.write_bytes(b"")
        elif self.path.exists():
            _cut_torn_tail(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append ``records`` as lines in a single write (atomic position with ``O_APPEND``)."""
        if not records:
            return
        if self._fd is None:
            raise ValueError(f"event log {self.path} is closed")
        data = "".join(
            json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n" for r in records
        ).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def sync(self) -> None:
        """fsync the log (survives power loss, not only a killed process)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


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
        warnings.warn(f"{path}: cutting a torn last line ({size - keep} bytes) left by a crash "
                      "before continuing the run log", RuntimeWarning, stacklevel=4)
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
                if rec is not None and rec.get("kind", "step") == "step" and "step" in rec \
                        and (at_most is None or int(rec["step"]) <= at_most):
                    return rec
            if start == 0:
                return None
            block *= 4


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


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

    def scaler_config(self) -> dict[str, Any]:
        return dict(self.meta.get("scaler") or {})


def load_run(run_dir: str | os.PathLike) -> RunLog:
    """Read a run folder written by :class:`ampguard.Telemetry`.

    Raises ``ValueError`` when ``run_dir`` has no ``meta.json``/``events.jsonl``. A torn or
    unreadable line is skipped with a ``RuntimeWarning`` (a crash mid-append tears only the last).
    """
    run_dir = Path(run_dir)
    meta_path, events_path = run_dir / META, run_dir / EVENTS
    if not meta_path.exists() or not events_path.exists():
        raise ValueError(f"run_dir {str(run_dir)!r} is not an ampguard run folder (needs {META} "
                         f"and {EVENTS}, written by ampguard.Telemetry)")
    meta = read_json(meta_path)
    records, events, bad = _read_events(events_path)
    return _assemble(run_dir, meta, records, events, bad)


def _read_events(path: Path) -> tuple[list[dict], list[dict], int]:
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    torn_tail = not raw.endswith(b"\n") and lines[-1] != b""
    steps: list[dict] = []
    events: list[dict] = []
    bad = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        rec = _parse(line)
        if rec is None or (rec.get("kind", "step") == "step" and "step" not in rec):
            bad += 1
            last = i == len(lines) - 1 and torn_tail
            what = "a torn last line (the writer was killed mid-append)" if last else \
                f"unreadable line {i + 1}"
            warnings.warn(f"{path}: skipping {what}", RuntimeWarning, stacklevel=3)
            continue
        kind = rec.get("kind", "step")
        if kind == "step":
            steps.append(rec)
            continue
        if kind == "resume":
            at = int(rec.get("step", 0))
            steps = [r for r in steps if int(r["step"]) <= at]  # re-run after the checkpoint
        events.append(rec)
    return steps, events, bad


def _col(records: list[dict], key: str, default: Any = math.nan) -> np.ndarray:
    return np.array([_nan(r.get(key, default)) for r in records], dtype=np.float64)


def _nan(v: Any) -> float:
    return math.nan if v is None else float(v)


def _matrix(rows: list[Any], width: int) -> np.ndarray:
    if not rows:
        return np.zeros((0, width))
    return np.array([[_nan(v) for v in row] for row in rows], dtype=np.float64).reshape(-1, width)


def _assemble(run_dir: Path, meta: dict, recs: list[dict], events: list[dict], bad: int) -> RunLog:
    layers = [str(n) for n in meta.get("layers", {}).get("names", [])]
    width = len(layers)
    lrecs = [r for r in recs if "layers" in r]
    rrecs = [r for r in recs if "range" in r]
    rng = [r["range"] for r in rrecs]
    return RunLog(
        run_dir=run_dir, meta=meta, layers=layers,
        steps=np.array([int(r["step"]) for r in recs], dtype=np.int64),
        scale_before=_col(recs, "scale_before"), scale=_col(recs, "scale"),
        applied=np.array([bool(r.get("applied", True)) for r in recs], dtype=bool),
        overflow=np.array([bool(r.get("overflow", False)) for r in recs], dtype=bool),
        collapse=np.array([bool(r.get("collapse", False)) for r in recs], dtype=bool),
        dropped=np.array([int(r.get("dropped", 0)) for r in recs], dtype=np.int64),
        loss=_col(recs, "loss"), grad_norm=_col(recs, "grad_norm"),
        precision=[str(r.get("precision", "")) for r in recs],
        layer_steps=np.array([int(r["step"]) for r in lrecs], dtype=np.int64),
        layer_applied=np.array([bool(r.get("applied", True)) for r in lrecs], dtype=bool),
        layer_norm=_matrix([r["layers"]["grad_norm"] for r in lrecs], width),
        range_steps=np.array([int(r["step"]) for r in rrecs], dtype=np.int64),
        range_applied=np.array([bool(r.get("applied", True)) for r in rrecs], dtype=bool),
        range_scale=_col(rrecs, "scale_before"),
        range_precision=[str(r.get("precision", "")) for r in rrecs],
        zero_frac=_matrix([g["zero_frac"] for g in rng], width),
        amax=_matrix([g["amax"] for g in rng], width),
        headroom_bits=_matrix([g["headroom_bits"] for g in rng], width),
        underflow=_matrix([g["underflow"] for g in rng], width),
        safe_lo=_matrix([g["safe_lo"] for g in rng], width),
        safe_hi=_matrix([g["safe_hi"] for g in rng], width),
        window=_matrix([g["window"] for g in rng], 2),
        events=events, bad_lines=bad,
        nonfinite=np.array([bool(r.get("nonfinite", False)) for r in recs], dtype=bool),
        loss_nonfinite=np.array([r.get("loss_nonfinite") is not None for r in recs], dtype=bool),
    )


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
        log.append([{"kind": FINDING_EVENT, "step": f.step, "finding": f.to_dict()}
                    for f in found])
    finally:
        log.close()
