"""Absorbed-overflow scans for ``Guard(auto_fallback=True)``: a clean window's forward, traced.

An absorbed overflow never makes a step overflow, so the Guard's arming (after an overflow)
never sees it. With ``auto_fallback`` the Guard therefore traces the forward pass of one window
every :func:`scan_every` windows (telemetry's ``range_every`` when telemetry range-samples,
else :data:`SCAN_EVERY`) with numerics. :func:`diagnose_absorbed` reads that trace once the
window has applied: the first half-precision op of the forward that made inf/NaN from finite
inputs, rerun from fp32 copies of its inputs (the trace's shadow), is *confirmed* when fp32
stays finite there; it becomes an ``fp16_overflow_absorbed`` diagnosis (AG360), and
auto_fallback keeps its module in fp32 like any other fp16 overflow.

Cost: nothing on other windows. A scanned window's forward runs traced (one reduction per op
output and input, a host sync per :data:`~ampguard.forensics._optrace.HUNT_BATCH` candidate
ops) plus one host sync to read the trace; its backward is not traced.
"""

from __future__ import annotations

import math
from typing import Any

from ampguard.forensics._diagnosis import Diagnosis
from ampguard.forensics._limits import MAX
from ampguard.forensics._optrace import LOW, OpTrace, is_new, op_info

__all__ = ["SCAN_EVERY", "scan_every", "diagnose_absorbed"]

SCAN_EVERY = 100  # windows between two scans when telemetry does not range-sample


def scan_every(guard: Any) -> int:
    """The scan cadence: telemetry's ``range_every`` if it range-samples, else SCAN_EVERY."""
    telemetry = getattr(guard, "telemetry", None)
    every = getattr(telemetry, "range_every", 0) if telemetry is not None else 0
    return int(every) if every else SCAN_EVERY


def diagnose_absorbed(trace: OpTrace, precision: str, scale: float) -> Diagnosis | None:
    """The confirmed absorbed overflow of a traced forward whose step applied, or None.

    Cost: one host sync (the trace's numbers).
    """
    stats = trace.stats()
    rows = [(e, stats[e.row]) for e in trace.events if e.row is not None and e.phase == "forward"]
    for i, (e, row) in enumerate(rows):
        if e.out_dtype not in LOW or not is_new(row, e.intentional):
            continue
        shadow = trace.shadow.get(e.index)
        if shadow is None or not math.isfinite(shadow):
            return None  # not confirmed: fp32 overflows too, or the op could not be rerun
        consumer = next(
            (
                c
                for c, r in rows[i + 1 :]
                if not math.isfinite(r[0]) and r[1] >= 0 and math.isfinite(r[1])
            ),
            None,
        )
        limit = MAX.get(precision, math.inf)
        source = "scanned training step (fp32 rerun of this op only)"
        info = op_info(e, row, shadow, scale=scale, precision=precision, limit=limit, source=source)
        info["absorbed_by"] = (
            None if consumer is None else {"module": consumer.module, "op": consumer.op}
        )
        return Diagnosis(
            "fp16_overflow_absorbed", "forward", e.module, e.op, info, precision, scale
        )
    return None
