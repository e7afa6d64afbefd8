"""Warm-up and skip causes: which steps the scale was still probing, and why steps were skipped.

Cost: array passes over the run log's columns, no I/O.
"""

from __future__ import annotations

import numpy as np

from ampguard.rules._base import RuleConfig
from ampguard.runlog import RunLog

__all__ = [
    "FORWARD_FIX",
    "NONFINITE_FORWARD",
    "forward_share",
    "loss_nonfinite",
    "skip_causes",
    "warmup_mask",
]

NONFINITE_FORWARD = "non-finite forward (NaN/inf loss)"
"""The :func:`skip_causes` key of skipped steps whose loss was non-finite."""


# ---------------------------------------------------------------------- warm-up and causes
def warmup_mask(run: RunLog, cfg: RuleConfig) -> np.ndarray:
    """True for steps in a warm-up: the scale probing its level after the start or a reset.

    A warm-up ends at its first scale growth or before its first ``warmup_clean_steps``
    consecutive applied steps, and lasts at most ``warmup_max_steps`` steps.
    """
    n = len(run.steps)
    warm = np.zeros(n, dtype=bool)
    starts = [0] + [
        int(np.searchsorted(run.steps, int(r["step"]), side="right"))
        for r in run.resumes
        if r.get("scale_reset")
    ]
    for start in sorted(set(starts)):
        clean = 0
        end = min(n, start + cfg.warmup_max_steps)
        for i in range(start, end):
            if run.scale[i] > run.scale_before[i]:  # the first growth: the level was found
                end = i
                break
            clean = clean + 1 if run.applied[i] else 0
            if clean >= cfg.warmup_clean_steps:
                end = i + 1 - clean
                break
        warm[start:end] = True
    return warm


def skip_causes(run: RunLog, cfg: RuleConfig | None = None) -> dict[str, list[int]]:
    """Skipped steps by cause: warm-up probing, collapse, every micro-batch dropped, a
    non-finite forward, overflow.

    A skipped step whose loss was NaN/inf is a non-finite forward (:data:`NONFINITE_FORWARD`),
    never a warm-up or gradient overflow: no loss scale makes a non-finite loss finite, so the
    fix lies in the forward. A step that a recorded forensics error (AG301/AG303/AG304) traced
    to a non-finite value is an overflow even inside the warm-up: the scale was not merely
    probing its level there.
    """
    warm = warmup_mask(run, cfg or RuleConfig())
    confirmed = _forensics_confirmed(run)
    accumulation = int(run.meta.get("guard", {}).get("accumulation_steps", 1))
    loss_bad = loss_nonfinite(run)
    out: dict[str, list[int]] = {
        "warm-up overflow": [],
        "collapse": [],
        "all micro-batches dropped": [],
        NONFINITE_FORWARD: [],
        "overflow": [],
        "non-finite gradients (no loss scaler)": [],
    }
    for i in np.flatnonzero(~run.applied):
        step = int(run.steps[i])
        # a NaN loss under a scaler (a collapse it caused included); without a scaler the skip
        # is AG109's count, whatever the loss was
        if loss_bad[i] and not run.nonfinite[i] and run.dropped[i] < accumulation:
            out[NONFINITE_FORWARD].append(step)
        elif run.collapse[i]:
            out["collapse"].append(step)
        elif run.dropped[i] >= accumulation:
            out["all micro-batches dropped"].append(step)
        elif run.nonfinite[i]:
            out["non-finite gradients (no loss scaler)"].append(step)
        elif warm[i] and step not in confirmed:  # forensics found the cause: no warm-up
            out["warm-up overflow"].append(step)
        else:
            out["overflow"].append(step)
    return out


def loss_nonfinite(run: RunLog) -> np.ndarray:
    """Per step: the window's loss was NaN/inf (False where the log has no such field)."""
    bad = run.loss_nonfinite
    return bad if len(bad) == len(run.steps) else np.zeros(len(run.steps), dtype=bool)


def forward_share(run: RunLog, idx: np.ndarray) -> tuple[int, int]:
    """(skipped steps among ``idx`` whose loss was non-finite, skipped steps among ``idx``)."""
    skipped = idx[~run.applied[idx]]
    return int(loss_nonfinite(run)[skipped].sum()), len(skipped)


FORWARD_FIX = (
    "The loss itself was NaN/inf, so no loss scale helps: find the forward module that "
    "produces it (ampguard.locate(model, loss_fn, batch) or Guard(forensics=True)) and keep it "
    "in fp32 (Guard(keep_fp32=[...])), check the data and any eps below 6e-8 (fp16's smallest "
    "subnormal), or train in bf16 (precision='bf16')."
)


def _forensics_confirmed(run: RunLog) -> set[int]:
    """Steps that a recorded forensics error (AG301/AG303/AG304, or an AG301 warning about a
    transient burst) traced to a real non-finite."""
    out: set[int] = set()
    for e in run.events:
        f = e.get("finding") if e.get("kind") == "finding" else None
        if not (
            isinstance(f, dict)
            and (f.get("severity") == "error" or (f.get("evidence") or {}).get("transient"))
            and str(f.get("code", "")).startswith("AG30")
        ):
            continue
        steps = (f.get("evidence") or {}).get("steps") or []  # every step the diagnosis saw
        out.update(int(s) for s in [f.get("step"), *steps] if isinstance(s, int))
    return out
