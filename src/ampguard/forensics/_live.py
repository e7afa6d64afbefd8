"""Live diagnosis of a guarded run: the pieces the Guard's forensics (``ampguard.guard._forensics``)
builds on that need no Guard: argument checks, the diagnosis of an overflowing window from its own
op trace, the replay check and the AG306 finding of an ``auto_fallback`` change.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampguard._util.checks import check_bool, check_int
from ampguard.findings import Finding, make
from ampguard.forensics._diagnosis import Diagnosis
from ampguard.forensics._limits import MAX
from ampguard.forensics._optrace import LOW, OpEvent, OpTrace, is_new, op_info
from ampguard.forensics.islands import match_modules

__all__ = ["check", "diagnose_trace", "fallback_finding", "reproduced"]


def check(
    model: torch.nn.Module, keep_fp32: Any, forensics: Any, auto_fallback: Any, coverage_step: Any
) -> None:
    """Check the Guard's forensics arguments (every ``keep_fp32`` pattern must match a module)
    without touching the model: the Guard calls it before anything else changes."""
    for name, value in (("forensics", forensics), ("auto_fallback", auto_fallback)):
        check_bool(name, value)
    check_int("coverage_step", coverage_step, optional=True)
    if keep_fp32:
        match_modules(model, keep_fp32)


def reproduced(diag: Diagnosis, logged_nonfinite: bool) -> Diagnosis:
    """``diag`` with ``stats["replay_reproduced"]``: whether the replay's loss is non-finite
    exactly when the step's logged loss was (a NaN loss the replay does not show means it
    replayed a different computation: data changed in ``loss_fn``, non-deterministic ops)."""
    replay_loss = diag.stats.get("replay_loss")
    replay_bad = isinstance(replay_loss, float) and not math.isfinite(replay_loss)
    diag.stats["logged_loss_nonfinite"] = bool(logged_nonfinite)
    diag.stats["replay_reproduced"] = replay_bad or not logged_nonfinite
    return diag


def fallback_finding(change: dict[str, Any]) -> Finding:
    """AG306: ``auto_fallback`` moved a module to fp32 (one change of the Guard's forensics)."""
    module = change["module"]
    return make(
        "AG306",
        f"Step {change['step']}: {module!r} overflowed fp16 in the {change['phase']} "
        f"pass ({change['op']}{'; the overflow was absorbed' if change.get('absorbed') else ''}"
        "); auto_fallback runs it outside autocast in fp32 from the next "
        "step on.",
        detail=repr(module),
        step=change["step"],
        evidence=dict(change),
        fix=f"Make it permanent with Guard(..., keep_fp32=[{module!r}]), or bound its "
        "values (normalisation, smaller init) so it fits fp16.",
    )


# ---------------------------------------------------------------------- live diagnosis
def diagnose_trace(
    trace: OpTrace, losses: list[torch.Tensor], scale: float, precision: str, floor: float = 1.0
) -> Diagnosis:
    """Diagnose an overflowing window from its own numerics trace (no fp32 replay).

    The first op that made a non-finite value names module, pass and op; its fp32 rerun (the
    trace's shadow) gives the kind: still non-finite in fp32 -> model_nonfinite; a backward
    value that fits fp16 at the scaler's floor ``floor`` (min_scale) -> benign probe; beyond
    fp16 -> fp16_overflow.
    Cost: one host sync.
    """
    stats = trace.stats()
    loss_ok = bool(torch.stack(losses).all()) if losses else True
    phases = ("backward",) if loss_ok else ("forward", "backward")
    rows = [(e, stats[e.row]) for e in trace.events if e.row is not None]
    e, row = next(
        ((e, r) for p in phases for e, r in rows if e.phase == p and is_new(r, e.intentional)),
        (None, None),
    )
    if e is None or row is None:
        return _untraced(rows, precision, scale)
    limit = MAX.get(precision, math.inf)
    shadow = trace.shadow.get(e.index)
    source = "armed training step (fp32 rerun of this op only)"
    info = op_info(e, row, shadow, scale=scale, precision=precision, limit=limit, source=source)
    if e.out_dtype not in LOW or (shadow is not None and not math.isfinite(shadow)):
        kind = "model_nonfinite"
    elif e.phase == "backward" and shadow is not None and shadow / scale * floor <= limit:
        return Diagnosis("none", e.phase, e.module, e.op, info, precision, scale, benign=True)
    elif shadow is not None and shadow <= limit:
        kind = "fp16_underflow"  # fits the range in fp32: a value flushed to zero made it
    else:
        kind = "fp16_overflow"
    return Diagnosis(kind, e.phase, e.module, e.op, info, precision, scale)


def _untraced(rows: list[tuple[OpEvent, list[float]]], precision: str, scale: float) -> Diagnosis:
    """No op made the non-finite value: it came in with the batch (or the state)."""
    e = next(
        (
            e
            for e, r in rows
            if e.phase == "forward" and e.module is not None and not math.isfinite(r[0])
        ),
        None,
    )
    if e is None:
        return Diagnosis(
            "none", None, None, None, {"note": "overflow not seen in the trace"}, precision, scale
        )
    return Diagnosis(
        "input_nonfinite",
        "forward",
        e.module,
        e.op,
        {"source": "armed training step"},
        precision,
        scale,
    )
