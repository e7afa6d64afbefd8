"""Reading a run folder back: :func:`load_run` into a :class:`RunLog` of columns.

Every line goes through :mod:`ampguard.runlog._schema`, so a malformed one is skipped with a
warning naming file, line and field. Cost: one pass over ``events.jsonl``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ampguard.runlog._files import open_regular, read_json_file, read_meta
from ampguard.runlog._names import EVENTS, META
from ampguard.runlog._read import read_columns
from ampguard.runlog._schema import RunFolderError, check_record, parse_line

__all__ = ["RunLog", "last_step_record", "load_run", "read_json"]


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; :class:`RunFolderError` (a ``ValueError``) naming the file when it is
    not valid JSON, is a folder or cannot be read."""
    return read_json_file(path)


def last_step_record(path: str | os.PathLike, at_most: int | None = None) -> dict[str, Any] | None:
    """The last complete step record of an event log (reads from the end), or ``None``.

    With ``at_most``, the last one whose step is ``<= at_most``. A log that is not a regular file
    (a FIFO in its place must not stall a resuming run) is a :class:`RunFolderError` naming it.
    """
    path = Path(path)
    if not path.exists():
        return None
    with open_regular(path) as fh:
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
