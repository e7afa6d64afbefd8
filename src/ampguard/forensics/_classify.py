"""Classify the replays of one batch: the first op that went non-finite, its evidence, the kind.

Each function reads the traced runs (:class:`~ampguard.forensics._replay.Run`, the low
precision's and the fp32 reference's) and returns a :class:`~ampguard.forensics.Diagnosis`;
none replays anything (that is :mod:`ampguard.forensics._locate`'s part). Cost: host reads of
the runs' already-copied statistics, no device work.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from ampguard.forensics import _optimizer
from ampguard.forensics._diagnosis import Diagnosis
from ampguard.forensics._limits import LOW_DTYPES, MAX, TINY
from ampguard.forensics._optrace import OpEvent, is_new
from ampguard.forensics._replay import Run
from ampguard.forensics._silent import (
    REL_ERROR,
    absorbed_overflow,
    grad_errors,
    partial_underflow,
)
from ampguard.precisions import REGISTRY

__all__ = [
    "at_first_new",
    "broken_state",
    "classify_low",
    "first_new",
    "input_nonfinite",
    "rows",
    "silent",
    "with_poisoned_buffers",
]


# ---------------------------------------------------------------------- classification
def _is_new(run: Run, e: OpEvent) -> bool:
    return is_new(run.row(e), e.intentional)


def first_new(run: Run) -> OpEvent | None:
    """The first op that made a non-finite value; forward ops count only if the loss is bad."""
    phases = ("forward", "backward") if not math.isfinite(run.loss) else ("backward",)
    for phase in phases:
        for e in run.events:
            if e.phase == phase and _is_new(run, e):
                return e
    return next((e for e, r in rows(run) if not math.isfinite(r[1])), None)


def _keys(run: Run) -> dict[tuple, int]:
    """(phase, module, op, occurrence) -> event index: aligns ops of two runs of one batch."""
    seen: Counter = Counter()
    out = {}
    for e in run.events:
        k = (e.phase, e.module, e.op)
        out[k + (seen[k],)] = e.index
        seen[k] += 1
    return out


def _counterpart(run: Run, e: OpEvent, other: Run) -> list[float] | None:
    seen = sum(
        1 for x in run.events[: e.index] if (x.phase, x.module, x.op) == (e.phase, e.module, e.op)
    )
    i = _keys(other).get((e.phase, e.module, e.op, seen))
    return None if i is None else other.row(other.events[i])


def _event_stats(run: Run, e: OpEvent, other: Run | None, low_name: str) -> dict[str, Any]:
    row = run.row(e) or [-1.0] * 5
    measured = row[3] >= 0  # counts exist for the first non-finite op of each pass
    stats: dict[str, Any] = {
        "dtype": str(e.out_dtype).replace("torch.", "") if e.out_dtype else None,
        "shape": list(e.shape),
        "nan_count": int(row[3]) if measured else None,
        "inf_count": int(row[4]) if measured else None,
        "scale": run.scale,
        "limit": MAX.get(low_name),
    }
    key = run.precision if REGISTRY[run.precision].is_full else low_name
    numel = math.prod(e.shape)
    all_bad = measured and numel and row[3] + row[4] >= numel
    if e.source is not None:  # an op of the loss code: the user's line that ran it
        stats["source"] = e.source
    stats[f"max_abs_{key}"] = row[2] if measured and not all_bad else None
    stats[f"input_max_abs_{key}"] = row[0]
    if other is not None:
        twin = _counterpart(run, e, other)
        okey = other.precision if REGISTRY[other.precision].is_full else low_name
        # backward values grow with the loss scale: state the other run's in this run's units
        factor = run.scale / other.scale if e.phase == "backward" else 1.0
        stats[f"max_abs_{okey}"] = None if twin is None or twin[1] < 0 else twin[1] * factor
        stats[f"input_max_abs_{okey}"] = None if twin is None or twin[0] < 0 else twin[0] * factor
    return stats


def at_first_new(
    run: Run, kind: str, low: str, other: Run | None = None, benign: bool = False
) -> Diagnosis:
    e = first_new(run)
    if e is None:
        return Diagnosis(kind, None, None, None, {"loss": run.loss}, low, run.scale, benign)
    return Diagnosis(
        kind, e.phase, e.module, e.op, _event_stats(run, e, other, low), low, run.scale, benign
    )


def classify_low(run: Run, ref: Run, e: OpEvent | None, name: str) -> Diagnosis:
    if e is None:
        return Diagnosis("fp16_overflow", None, None, None, {"loss": run.loss}, name, run.scale)
    stats = _event_stats(run, e, ref, name)
    kind = "fp16_overflow"
    twin = _counterpart(run, e, ref)
    if twin is not None and 0 <= twin[1] <= MAX[name] and 0 <= twin[0] < TINY[name]:
        kind = "fp16_underflow"  # e.g. log or 1/x of a value that flushed to zero
    return Diagnosis(kind, e.phase, e.module, e.op, stats, name, run.scale)


def rows(run: Run) -> list[tuple[OpEvent, list[float]]]:
    return [(e, run.stats[e.row]) for e in run.events if e.row is not None]


def _underflow(low: Run, ref: Run) -> Diagnosis | None:
    dead = [n for n in low.order if low.grads.get(n) == 0.0 and ref.grads.get(n, 0.0) > 0.0]
    if not dead:
        return None
    module = dead[0].rpartition(".")[0]
    flush = next(
        (
            e
            for e, r in rows(low)
            if e.phase == "backward"
            and r[1] == 0.0
            and r[0] > 0.0
            and _flushed_only_here(low, e, ref)
        ),
        None,
    )
    stats = {
        "dead_parameters": dead,
        "grad_max_abs_fp32": ref.grads[dead[0]],
        "grad_max_abs_" + low.precision: 0.0,
        "scale": low.scale,
        "flushed_by": None if flush is None else {"module": flush.module, "op": flush.op},
    }
    return Diagnosis(
        "fp16_underflow",
        "backward",
        module,
        None if flush is None else flush.op,
        stats,
        low.precision,
        low.scale,
    )


def silent(low: Run, ref: Run) -> Diagnosis | None:
    """Loss and gradients finite: an absorbed forward overflow, a dead layer, or a layer that
    loses a large share of its gradient elements (see :mod:`ampguard.forensics._silent`)."""
    absorbed = absorbed_overflow(low, ref, _counterpart)
    if absorbed is not None:
        e, consumer = absorbed["event"], absorbed["consumer"]
        stats = _event_stats(low, e, ref, low.precision)
        stats["absorbed_by"] = (
            None if consumer is None else {"module": consumer.module, "op": consumer.op}
        )
        stats["loss"], stats["loss_fp32"] = low.loss, ref.loss
        return Diagnosis(
            "fp16_overflow_absorbed", "forward", e.module, e.op, stats, low.precision, low.scale
        )
    dead = _underflow(low, ref)
    if dead is not None:
        return dead
    errors = grad_errors(low, ref)
    partial = partial_underflow(low, ref)
    if partial is None:
        return _wrong_gradients(low, ref, errors)
    stats = {
        "underflow_share": partial["share"],
        "layers": partial["layers"],
        "flushed": partial["flushed"],
        "lossy_subnormal": partial["lossy"],
        "nonzero_fp32": partial["nonzero_fp32"],
        "threshold": partial["threshold"],
        "lossy_bits": partial["lossy_bits"],
        "scale": low.scale,
        "grad_rel_error": _rounded(errors),
    }
    return Diagnosis(
        "fp16_underflow", "backward", partial["module"], None, stats, low.precision, low.scale
    )


def _rounded(errors: dict[str, float]) -> dict[str, float]:
    return {m: round(v, 4) for m, v in errors.items()}


def _wrong_gradients(low: Run, ref: Run, errors: dict[str, float]) -> Diagnosis | None:
    """No element flushed or coarse, yet a layer's gradient is more than :data:`REL_ERROR`
    (relative L2) off fp32's: underflow when a backward op's values upstream of it lie below
    the low dtype's smallest normal in fp32 too (the contributions that flushed there are
    missing from the sum); None otherwise (the errors stay in the ``none`` diagnosis' stats)."""
    wrong = {m: v for m, v in errors.items() if v > REL_ERROR}
    if not wrong:
        return None
    worst = max(wrong, key=lambda m: wrong[m])
    tiny = TINY.get(low.precision, 0.0)
    flush = next(
        (
            e
            for e, r in rows(low)
            if e.phase == "backward"
            and e.out_dtype in LOW_DTYPES
            and 0.0 <= r[1] < tiny
            and 0.0 < _full_value(low, e, r, ref) < tiny
        ),
        None,
    )
    if flush is None:
        return None
    stats = {
        "grad_rel_error": _rounded(errors),
        "rel_error": round(wrong[worst], 4),
        "rel_error_threshold": REL_ERROR,
        "layers": _rounded(wrong),
        "flushed_by": {"module": flush.module, "op": flush.op},
        "scale": low.scale,
    }
    return Diagnosis("fp16_underflow", "backward", worst, flush.op, stats, low.precision, low.scale)


def _full_value(low: Run, e: OpEvent, row: list[float], ref: Run) -> float:
    """``e``'s max |output| in fp32, in ``low``'s units: its fp32 twin's, or for a cast down
    to the low dtype (no twin in fp32) the cast's own input; -1 when unknown."""
    twin = _counterpart(low, e, ref)
    if twin is not None and twin[1] >= 0:
        return twin[1] * low.scale / ref.scale
    return row[0] if e.op == "aten._to_copy" else -1.0


def _flushed_only_here(low: Run, e: OpEvent, ref: Run) -> bool:
    twin = _counterpart(low, e, ref)
    return twin is None or twin[1] > 0.0


def input_nonfinite(low: Run, bad: list[dict[str, Any]], scale: float) -> Diagnosis:
    bad_in = [e for e, r in rows(low) if e.phase == "forward" and not math.isfinite(r[0])]
    first = next((e for e in bad_in if e.module is not None), bad_in[0] if bad_in else None)
    stats = {
        "inputs": bad,
        "nan_count": sum(b["nan"] for b in bad),
        "inf_count": sum(b["inf"] for b in bad),
    }
    if first is None:
        return Diagnosis("input_nonfinite", "forward", None, None, stats, low.precision, scale)
    return Diagnosis(
        "input_nonfinite", "forward", first.module, first.op, stats, low.precision, scale
    )


def broken_state(
    bad: list[str], precision: str, scale: float, optimizer: torch.optim.Optimizer | None
) -> Diagnosis:
    """Non-finite parameters before any run: only an optimizer step writes parameters."""
    stats: dict[str, Any] = {"nonfinite_tensors": bad}
    eps = _optimizer.eps_underflows(optimizer) if optimizer is not None else []
    module = bad[0].rpartition(".")[0]
    if eps:
        stats["eps_underflow"] = eps
        return Diagnosis(
            "eps_underflow", "optimizer", module, "optimizer.step", stats, precision, scale
        )
    return Diagnosis("model_nonfinite", "optimizer", module, None, stats, precision, scale)


def with_poisoned_buffers(diag: Diagnosis, bad: list[str]) -> Diagnosis:
    """Finite parameters, non-finite buffers: poisoned by this batch's low-precision forward
    (an AMP problem: the overflow diagnosis stands), or broken before this step."""
    if diag.kind in ("fp16_overflow", "fp16_underflow") and diag.phase == "forward":
        return Diagnosis(
            diag.kind,
            diag.phase,
            diag.module,
            diag.op,
            {**diag.stats, "poisoned_buffers": bad},
            diag.precision,
            diag.scale,
        )
    return Diagnosis(
        "model_nonfinite",
        None,
        bad[0].rpartition(".")[0],
        None,
        {"nonfinite_tensors": bad, "broken_before_step": True, "replay": diag.kind},
        diag.precision,
        diag.scale,
    )
