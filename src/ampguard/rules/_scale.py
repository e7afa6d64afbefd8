"""The loss-scale rules: AG101 collapse, AG102 oscillation, AG103 skip rate, AG107 resume gap.

Cost: array passes over the run log's columns, no I/O.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ampguard.findings import Finding, count
from ampguard.rules._base import RuleConfig
from ampguard.rules._base import make_finding as _finding
from ampguard.rules._warmup import (
    FORWARD_FIX,
    forward_share,
    skip_causes,
)
from ampguard.runlog import RunLog

__all__ = ["ag101", "ag102", "ag103", "ag107"]


# ---------------------------------------------------------------------- scale rules
def ag101(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    sc = run.scaler_config()
    min_scale = float(sc.get("min_scale", 1.0))
    fix = (
        "Find the module that overflows (ampguard.locate) and keep it in fp32 "
        "(ampguard.forensics.islands.keep_fp32(model, [name])), lower the learning rate or clip "
        "gradients, or train "
        "in bf16 (precision='bf16'); ScalerConfig(on_collapse='fallback') switches "
        "automatically."
    )
    if run.collapse.any():
        idx = np.flatnonzero(run.collapse)
        step = int(run.steps[idx[0]])
        forward, _ = forward_share(run, idx)
        what = (
            f"the loss was NaN/inf (a non-finite forward) on {forward} of them"
            if forward
            else "gradients overflowed"
        )
        return [
            _finding(
                "AG101",
                "error",
                f"the loss scale collapsed: {count(len(idx), 'step')} skipped at min_scale="
                f"{min_scale:g}, first at step {step}; {what}, and the model "
                f"did not learn from {'it' if len(idx) == 1 else 'them'}.",
                step,
                {
                    "collapse_steps": run.steps[idx[:20]].tolist(),
                    "collapses": len(idx),
                    "min_scale": min_scale,
                    "nonfinite_loss_steps": forward,
                },
                FORWARD_FIX if forward * 2 >= len(idx) else fix,
            )
        ]
    if not sc.get("dynamic", True) or len(run.steps) == 0:
        return []
    floor = min_scale * cfg.collapse_floor_factor
    low = np.flatnonzero(run.overflow & (run.scale <= floor))
    if len(low) and float(sc.get("init_scale", 2.0**16)) > floor:
        i = int(low[0])
        forward, skipped = forward_share(run, np.flatnonzero(run.overflow))
        what = "skipped steps" if forward == skipped else "overflows"
        why = (
            f"; {forward} of the {skipped} skipped steps had a NaN/inf loss (a non-finite "
            "forward, not overflowing gradients)"
            if forward
            else ""
        )
        return [
            _finding(
                "AG101",
                "warning",
                f"{what} drove the loss scale down to {run.scale[i]:g} at step "
                f"{int(run.steps[i])}, within {cfg.collapse_floor_factor:g}x of "
                f"min_scale={min_scale:g}{why}: one more bad stretch and every step is "
                "skipped.",
                int(run.steps[i]),
                {
                    "scale": run.scale[i],
                    "min_scale": min_scale,
                    "overflow_steps": run.steps[low[:20]].tolist(),
                    "nonfinite_loss_steps": forward,
                },
                FORWARD_FIX if forward * 2 >= max(skipped, 1) else fix,
            )
        ]
    return _net_drop(run, cfg, warm, fix)


def _net_drop(run: RunLog, cfg: RuleConfig, warm: np.ndarray, fix: str) -> list[Finding]:
    post = np.flatnonzero(~warm)
    if len(post) < 2:
        return []
    logs = np.log2(np.maximum(run.scale[post], 1e-30))
    w = min(cfg.collapse_window, len(post))
    peaks = sliding_window_view(np.concatenate([np.full(w - 1, -np.inf), logs]), w).max(axis=1)
    drop = peaks - logs
    worst = int(np.argmax(drop))
    if drop[worst] < cfg.collapse_halvings:
        return []
    step = int(run.steps[post[worst]])
    forward, skipped = forward_share(run, post[max(0, worst - w + 1) : worst + 1])
    if forward and forward == skipped:
        why = f"every skipped step in it ({forward}) had a NaN/inf loss: the forward is non-finite"
    elif forward:
        why = (
            f"{forward} of its {skipped} skipped steps had a NaN/inf loss (a non-finite "
            "forward), the others overflowing gradients"
        )
    else:
        why = "the gradients keep overflowing"
    return [
        _finding(
            "AG101",
            "warning",
            f"the loss scale fell by 2^{drop[worst]:.0f} (to {run.scale[post[worst]]:g})"
            f" within {w} steps, ending at step {step}: {why} "
            "and the scale is heading for min_scale.",
            step,
            {
                "halvings": drop[worst],
                "window_steps": w,
                "scale": run.scale[post[worst]],
                "nonfinite_loss_steps": forward,
            },
            FORWARD_FIX if forward * 2 >= max(skipped, 1) else fix,
        )
    ]


def ag102(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    post = np.flatnonzero(~warm)
    if len(post) == 0:
        return []
    before, after = run.scale_before[post], run.scale[post]
    events = [
        (i, "grow" if a > b else "back")
        for i, b, a in zip(post, before, after, strict=True)
        if a != b
    ]
    cycles = [
        (int(run.steps[j]), float(run.scale[i]))
        for (i, e1), (j, e2) in zip(events, events[1:], strict=False)
        if e1 == "grow" and e2 == "back" and run.scale_before[j] == run.scale[i]
    ]
    if len(cycles) < cfg.osc_min_cycles or len(cycles) / len(post) < cfg.osc_min_rate:
        return []
    tops, counts = np.unique([top for _, top in cycles], return_counts=True)
    top = float(tops[int(np.argmax(counts))])
    interval = int(run.scaler_config().get("growth_interval", 2000))
    gaps = np.diff([s for s, _ in cycles])
    period = float(np.median(gaps)) if len(gaps) else math.nan
    return [
        _finding(
            "AG102",
            "warning",
            f"the loss scale oscillated: {len(cycles)} grow -> overflow -> back-off "
            f"cycles after warm-up (one every ~{period:.0f} steps), most often at "
            f"scale {top:g}; each cycle skips a step.",
            cycles[0][0],
            {
                "cycles": len(cycles),
                "top_scale": top,
                "median_period": period,
                "growth_interval": interval,
                "cycle_steps": [s for s, _ in cycles[:20]],
            },
            f"Grow less often: ScalerConfig(growth_interval={interval * 4}), or cap the "
            f"scale below the cycle's top: ScalerConfig(max_scale={top / 2:g}).",
        )
    ]


def ag103(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    post = np.flatnonzero(~warm)
    if len(post) < cfg.skip_min_steps:
        return _short_run_skips(run, cfg)
    skipped = (~run.applied[post]).astype(np.float64)
    w = min(cfg.skip_window, len(post))
    rates = sliding_window_view(skipped, w).mean(axis=1)
    worst = int(np.argmax(rates))
    if rates[worst] <= cfg.skip_rate:
        return []
    first, last = int(run.steps[post[worst]]), int(run.steps[post[worst + w - 1]])
    causes = {k: len(v) for k, v in skip_causes(run, cfg).items() if v}
    return [
        _finding(
            "AG103",
            "warning",
            f"{rates[worst]:.0%} of steps {first}-{last} were skipped (threshold "
            f"{cfg.skip_rate:.0%}, warm-up excluded); {int(skipped.sum())} of "
            f"{len(post)} steps after warm-up skipped in all.",
            first,
            {
                "window": [first, last],
                "rate": rates[worst],
                "skipped_after_warmup": int(skipped.sum()),
                "steps_after_warmup": len(post),
                "causes": causes,
            },
            "Skipped steps are lost work: see the AG101/AG102 findings if present; "
            "otherwise find the overflowing module (ampguard.locate) and keep it in "
            "fp32, lower the learning rate or clip gradients, or use precision='bf16'.",
        )
    ]


def _short_run_skips(run: RunLog, cfg: RuleConfig) -> list[Finding]:
    """AG103 at info level for a run too short to judge its skip rate (fewer than
    ``skip_min_steps`` steps after warm-up) that lost steps to more than warm-up probing: more
    than ``skip_rate`` of its steps skipped for other causes, or more than half of all its steps
    skipped. A short run otherwise gets no word about the steps it lost; warm-up probing alone
    is expected and stays out (the summary's cause line shows it)."""
    n, skipped = len(run.steps), int((~run.applied).sum())
    if n == 0 or skipped == 0:
        return []
    causes = {k: len(v) for k, v in skip_causes(run, cfg).items() if v}
    other = skipped - causes.get("warm-up overflow", 0)
    if other / n <= cfg.skip_rate and skipped / n <= 0.5:
        return []
    said = ", ".join(f"{k} {v}" for k, v in causes.items())
    return [
        _finding(
            "AG103",
            "info",
            f"{skipped} of {n} steps were skipped ({said}); the run is too short to "
            f"judge its skip rate (fewer than {cfg.skip_min_steps} steps after warm-up)"
            ", so this is a summary, not a warning.",
            int(run.steps[~run.applied][0]),
            {
                "skipped": skipped,
                "steps": n,
                "causes": causes,
                "skip_min_steps": cfg.skip_min_steps,
            },
            "Warm-up overflows are the scale finding its level and cost a few steps "
            "once; other overflows: find the overflowing module (ampguard.locate) or "
            "use precision='bf16'. Train longer for the skip-rate verdict.",
        )
    ]


# ---------------------------------------------------------------------- resume and range
def ag107(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    out = []
    for r in run.resumes:
        prev, new = r.get("previous_scale"), r.get("scale")
        if not prev or not new or prev <= 0 or new <= 0:
            continue
        gap = abs(math.log2(new / prev))
        reset = bool(r.get("scale_reset"))
        if not ((reset and gap > 0) or gap >= cfg.resume_gap_bits):
            continue
        step = int(r["step"])
        why = (
            "was reset to init_scale (the checkpoint had no loss-scaler state)"
            if reset
            else f"differs by 2^{gap:.0f} from the one before the interruption"
        )
        out.append(
            _finding(
                "AG107",
                "warning",
                f"resumed at step {step} with loss scale {new:g}, which {why} ({prev:g}): the next "
                "steps probe the scale again, overflowing or underflowing meanwhile.",
                step,
                {
                    "step": step,
                    "previous_scale": prev,
                    "scale": new,
                    "gap_bits": gap,
                    "scale_reset": reset,
                },
                "Lower the learning rate for a few hundred steps after the resume "
                "(Guard(..., resume_warmup=ampguard.ResumeWarmup(steps=200, lr_factor=0.1))), and "
                "save the Guard with the checkpoint (ampguard.save_checkpoint(..., guard=guard)) "
                "so "
                "the scale is restored.",
            )
        )
    return out
