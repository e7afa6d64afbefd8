"""Stream ``events.jsonl`` into compact columns (the arrays of :class:`ampguard.runlog.RunLog`).

One pass, one line at a time: each line is parsed, checked against :mod:`ampguard.runlog._schema`
and appended to typed arrays (8 bytes a number), so a million-step log needs tens of MB, not the
GB its per-line dicts would. A resume line drops the rows re-run after its step.
"""

from __future__ import annotations

import math
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from ampguard.runlog._files import iter_lines
from ampguard.runlog._schema import RANGE_FIELDS, LineWarnings, check_record, parse_line

__all__ = ["read_columns"]

_NAN = math.nan


def _f(v: Any) -> float:
    return _NAN if v is None else float(v)


class _Family:
    """Rows of one record family (every step, layer samples, range samples)."""

    def __init__(
        self,
        floats: tuple[str, ...],
        bools: tuple[str, ...],
        ints: tuple[str, ...],
        texts: tuple[str, ...],
    ) -> None:
        self.steps = array("q")
        self.cols: dict[str, Any] = {k: array("d") for k in floats}
        self.cols.update({k: bytearray() for k in bools})
        self.cols.update({k: array("q") for k in ints})
        self.cols.update({k: [] for k in texts})
        self.sorted = True

    def start(self, step: int) -> None:
        if self.steps and step < self.steps[-1]:
            self.sorted = False
        self.steps.append(step)

    def drop_after(self, at: int) -> None:
        """Drop every row whose step is > ``at`` (re-run after a checkpoint)."""
        if not self.steps or (self.sorted and self.steps[-1] <= at):
            return
        n = len(self.steps)
        keep = np.frombuffer(self.steps, dtype=np.int64) <= at
        if self.sorted:  # the rows to drop are a tail
            cut = int(keep.sum())
            for col in (self.steps, *self.cols.values()):
                del col[cut * (len(col) // n) :]
            return
        self.sorted = True
        for key, col in [("steps", self.steps), *self.cols.items()]:
            per = len(col) // n
            mask = np.repeat(keep, per)
            if isinstance(col, list):
                new: Any = [v for v, k in zip(col, mask.tolist(), strict=True) if k]
            elif isinstance(col, bytearray):
                new = bytearray(np.frombuffer(col, dtype=np.uint8)[mask].tobytes())
            else:
                new = array(
                    col.typecode, np.frombuffer(col, dtype=_DT[col.typecode])[mask].tobytes()
                )
            if key == "steps":
                self.steps = new
            else:
                self.cols[key] = new
        if len(self.steps) > 1:
            self.sorted = bool((np.diff(np.frombuffer(self.steps, dtype=np.int64)) >= 0).all())

    def array(self, key: str, width: int | None = None) -> np.ndarray:
        col = self.cols[key]
        if width == 0:
            return np.zeros((len(self.steps), 0))
        if isinstance(col, bytearray):
            return np.frombuffer(bytes(col), dtype=np.uint8).astype(bool)
        out = np.frombuffer(col, dtype=_DT[col.typecode]).copy()
        return out if width is None else out.reshape(-1, width)


_DT = {"d": np.float64, "q": np.int64}


class _Reader:
    def __init__(self, width: int) -> None:
        self.width = width
        self.main = _Family(
            ("scale_before", "scale", "loss", "grad_norm"),
            ("applied", "overflow", "collapse", "nonfinite", "loss_nonfinite"),
            ("dropped",),
            ("precision",),
        )
        self.layer = _Family(("norm",), ("applied",), (), ())
        self.range = _Family(("scale", *RANGE_FIELDS, "window"), ("applied",), (), ("precision",))
        self.events: list[dict[str, Any]] = []
        self._texts: dict[str, str] = {}
        self._bind()

    def _bind(self) -> None:
        """Bound ``append`` methods of the main columns (re-bound after a resume rebuilds them)."""
        c = self.main.cols
        self._append = tuple(
            c[k].append
            for k in (
                "scale_before",
                "scale",
                "loss",
                "grad_norm",
                "applied",
                "overflow",
                "collapse",
                "nonfinite",
                "loss_nonfinite",
                "dropped",
                "precision",
            )
        )

    def add_step(self, rec: dict[str, Any]) -> None:
        get = rec.get
        step, applied = rec["step"], get("applied", True)
        precision = get("precision", "")
        precision = self._texts.setdefault(precision, precision)  # one str object per value
        self.main.start(step)
        (
            a_before,
            a_scale,
            a_loss,
            a_norm,
            a_applied,
            a_over,
            a_coll,
            a_nonfinite,
            a_loss_nonfinite,
            a_drop,
            a_prec,
        ) = self._append
        v = get("scale_before")
        a_before(_NAN if v is None else v)
        v = get("scale")
        a_scale(_NAN if v is None else v)
        v = get("loss")
        a_loss(_NAN if v is None else v)
        v = get("grad_norm")
        a_norm(_NAN if v is None else v)
        a_applied(applied)
        a_over(get("overflow", False))
        a_coll(get("collapse", False))
        a_nonfinite(get("nonfinite", False))
        a_loss_nonfinite("loss_nonfinite" in rec)
        a_drop(get("dropped", 0))
        a_prec(precision)
        layers = get("layers")
        if layers is not None:
            self.layer.start(step)
            self.layer.cols["applied"].append(applied)
            self.layer.cols["norm"].extend([_NAN if v is None else v for v in layers["grad_norm"]])
        rng = get("range")
        if rng is not None:
            r = self.range
            r.start(step)
            r.cols["applied"].append(applied)
            r.cols["scale"].append(_f(get("scale_before")))
            r.cols["precision"].append(precision)
            for key in (*RANGE_FIELDS, "window"):
                r.cols[key].extend([_NAN if v is None else v for v in rng[key]])

    def add_event(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") == "resume":
            at = rec["step"]
            for family in (self.main, self.layer, self.range):
                family.drop_after(at)
            self._bind()
        self.events.append(rec)


def read_columns(path: Path, width: int, *, failed_writes: bool = False) -> dict[str, Any]:
    """The arrays of a run log with ``width`` layers, plus ``events`` and ``bad_lines``.

    A malformed line right before an ``unrecorded`` event is the fragment of a write that
    failed (a full disk whose partial line could not be cut back) and is named so; a torn last
    line is a writer killed mid-append, or, with ``failed_writes`` (``meta.json`` records
    unwritten steps), possibly a failed write.
    Raises :class:`ampguard.runlog._schema.RunFolderError` when ``path`` cannot be read as a file.
    Cost: one streamed pass over the file.
    """
    reader = _Reader(width)
    note = LineWarnings(path)
    held: tuple[int, str, bool] | None = None  # a bad line whose cause the next line tells
    for number, line, complete in iter_lines(path):
        rec = parse_line(line)
        bad = rec if isinstance(rec, str) else check_record(rec, width)
        if held is not None:
            failed = bad is None and isinstance(rec, dict) and rec.get("kind") == "unrecorded"
            _warn_bad(note, held, failed, failed_writes, rec)
            held = None
        if bad is not None:
            held = (number, bad, complete)
            continue
        assert isinstance(rec, dict)
        if rec.get("kind", "step") == "step":
            reader.add_step(rec)
        else:
            reader.add_event(rec)
    if held is not None:
        _warn_bad(note, held, False, failed_writes, None)
    note.close()
    return _arrays(reader, note.count)


def _warn_bad(
    note: LineWarnings, held: tuple[int, str, bool], failed: bool, failed_writes: bool, nxt: Any
) -> None:
    number, bad, complete = held
    if failed:
        where = f"line {number} (the partial line of a write that failed: {nxt.get('reason')})"
    elif complete:
        where = f"line {number}"
    elif failed_writes:
        where = (
            f"line {number} (a torn last line: a write that failed on a full disk, or the "
            "writer was killed mid-append)"
        )
    else:
        where = f"line {number} (a torn last line: the writer was killed mid-append)"
    note.warn(where, bad)


def _arrays(r: _Reader, bad: int) -> dict[str, Any]:
    m, lay, rng, w = r.main, r.layer, r.range, r.width
    return {
        "steps": np.frombuffer(m.steps, dtype=np.int64).copy(),
        "scale_before": m.array("scale_before"),
        "scale": m.array("scale"),
        "applied": m.array("applied"),
        "overflow": m.array("overflow"),
        "collapse": m.array("collapse"),
        "dropped": m.array("dropped"),
        "nonfinite": m.array("nonfinite"),
        "loss_nonfinite": m.array("loss_nonfinite"),
        "loss": m.array("loss"),
        "grad_norm": m.array("grad_norm"),
        "precision": list(m.cols["precision"]),
        "layer_steps": np.frombuffer(lay.steps, dtype=np.int64).copy(),
        "layer_applied": lay.array("applied"),
        "layer_norm": lay.array("norm", w),
        "range_steps": np.frombuffer(rng.steps, dtype=np.int64).copy(),
        "range_applied": rng.array("applied"),
        "range_scale": rng.array("scale"),
        "range_precision": list(rng.cols["precision"]),
        **{k: rng.array(k, w) for k in RANGE_FIELDS},
        "window": rng.array("window", 2),
        "events": r.events,
        "bad_lines": bad,
    }
