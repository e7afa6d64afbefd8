"""Turn one flush worth of device rows (now on the host) into JSON-ready step records."""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple, cast

import numpy as np

from ampguard.core import results
from ampguard.rules import _ranges
from ampguard.runlog import floats, num

__all__ = ["RowInfo", "RunTally", "build_records", "SCALE", "STATUS", "LOSS", "NORM", "FIXED"]

SCALE, STATUS, LOSS, NORM, FIXED = 0, 1, 2, 3, 4  # columns of a step row


class RowInfo(NamedTuple):
    """Host-side facts about a recorded step (its values are in the device row)."""

    step: int
    micro: int  # losses recorded in the window (0: none, the record's loss is null)
    scaled: bool  # a loss scaler was in use
    grads_scaled: bool  # recorded gradients still carried the loss scale (fused, no clipping)
    layers: bool
    guard_norm: bool  # column NORM holds the Guard's own (clipping) grad norm
    range_slot: int  # -1: no range sample
    precision: str
    n_opt: int


def build_records(
    infos: list[RowInfo],
    rows: np.ndarray,
    ranges: np.ndarray,
    *,
    carry: float,
    n_layers: int,
    layer_stats: bool,
) -> tuple[list[dict[str, Any]], float]:
    """Records for ``infos``; ``carry`` is the scale before the first row. Returns the records
    and the scale after the last row (the next flush's carry)."""
    out = []
    for info, row in zip(infos, rows, strict=True):
        before = carry if info.scaled else 1.0
        after = float(row[SCALE]) if info.scaled else 1.0
        flags = results.decode(int(row[STATUS]), info.n_opt, info.scaled)
        rec: dict[str, Any] = {
            "step": info.step,
            "scale_before": num(before),
            "scale": num(after),
            "applied": flags.applied,
            "overflow": flags.overflow,
            "collapse": flags.collapse,
            "nonfinite": flags.nonfinite,
            "dropped": flags.dropped,
            "loss": num(row[LOSS] / info.micro) if info.micro else None,
            "precision": info.precision,
        }
        if info.micro and rec["loss"] is None:  # NaN/inf/-inf stay distinct from "no loss"
            rec["loss_nonfinite"] = nonfinite_name(float(row[LOSS]))
        if flags.overflow and info.n_opt > 1:
            rec["overflowed"] = [i for i, ok in enumerate(flags.applied_per_optimizer) if not ok]
        inv = 1.0 / before if info.grads_scaled else 1.0
        if info.layers and layer_stats:
            sq = row[FIXED:].astype(np.float64) * inv * inv
            rec["grad_norm"] = num(np.sqrt(sq.sum()))
            rec["layers"] = {"grad_norm": floats(np.sqrt(sq))}
        elif info.layers:
            rec["grad_norm"] = num(row[NORM] * inv)
        elif info.guard_norm:
            rec["grad_norm"] = num(row[NORM])
        if info.range_slot >= 0:
            rec["range"] = _range_record(ranges[info.range_slot], n_layers, before)
        out.append(rec)
        carry = after if info.scaled else carry
    return out, carry


def nonfinite_name(value: float) -> str:
    """``"nan"``, ``"inf"`` or ``"-inf"`` for a non-finite loss (the record's ``loss`` is null)."""
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


def _range_record(row: np.ndarray, n_layers: int, scale: float) -> dict[str, Any]:
    amax = row[:n_layers].astype(np.float64)
    hist = row[n_layers:].astype(np.float64).reshape(n_layers, _ranges.BINS)
    s = _ranges.summarize(hist, amax, scale)
    lo, hi = cast("tuple[float, float]", s["window"])
    return {
        "zero_frac": floats(hist[:, 0] / np.maximum(hist.sum(axis=1), 1.0)),
        "amax": floats(s["amax"]),
        "headroom_bits": floats(s["headroom_bits"]),
        "underflow": floats(s["underflow"]),
        "safe_lo": floats(s["safe_lo"]),
        "safe_hi": floats(s["safe_hi"]),
        "window": [num(lo), num(hi)],
    }


class RunTally:
    """Running host-side totals over flushed records (the cheap accessors of Telemetry)."""

    def __init__(self, accumulation_steps: int, recent: int = 256) -> None:
        self.accumulation_steps = accumulation_steps
        self.recent: deque[tuple[int, float]] = deque(maxlen=recent)
        self.skips = {"overflow": 0, "dropped_microbatches": 0, "collapse": 0, "nonfinite": 0}
        self.totals = {
            "steps": 0,
            "scale_changes": 0,
            "consecutive_skips": 0,
            "microbatches_dropped": 0,
            "last_step": 0,
        }

    def add(self, records: list[dict[str, Any]]) -> list[float]:
        """Count ``records``; returns the running skip rate after each."""
        t, rates = self.totals, []
        for rec in records:
            t["steps"] += 1
            t["last_step"] = rec["step"]
            t["microbatches_dropped"] += rec["dropped"]
            t["scale_changes"] += rec["scale"] != rec["scale_before"]
            self.recent.append((rec["step"], rec["scale"]))
            if rec["applied"]:
                t["consecutive_skips"] = 0
            else:
                t["consecutive_skips"] += 1
                cause = (
                    "collapse"
                    if rec["collapse"]
                    else "dropped_microbatches"
                    if rec["dropped"] >= self.accumulation_steps
                    else "nonfinite"
                    if rec.get("nonfinite")
                    else "overflow"
                )
                self.skips[cause] += 1
            rates.append(sum(self.skips.values()) / t["steps"])
        return rates

    def recent_scales(self, k: int) -> list[tuple[int, float]]:
        return list(self.recent)[-k:] if k > 0 else []

    def summary(self) -> dict[str, Any]:
        return {**self.totals, "skips": dict(self.skips), "recent_scales": self.recent_scales(32)}
