"""Runtime rules AG101-AG110: findings over a run log written by :class:`ampguard.Telemetry`.

Every threshold is a field of :class:`RuleConfig` (defaults below). Warm-up is excluded where the
rule is about a steady state: from the run start (and from a resume that reset the scale) until
the first scale growth or ``warmup_clean_steps`` consecutive applied steps, at most
``warmup_max_steps`` steps, the scale is still finding its level from ``init_scale`` and its
overflows are expected.

========  =====================  ===============================================================
code      title                  fires when
========  =====================  ===============================================================
AG101     loss scale collapse    a step overflowed at ``min_scale`` (error); or an overflow left
                                 the scale within ``collapse_floor_factor`` of ``min_scale``; or
                                 after warm-up it fell by ``2**collapse_halvings`` within
                                 ``collapse_window`` steps
AG102     loss scale oscillation ``osc_min_cycles`` or more grow -> overflow -> back-off cycles
                                 after warm-up, at least ``osc_min_rate`` cycles per step
AG103     high skip rate         after warm-up, more than ``skip_rate`` of the steps in some
                                 ``skip_window``-step window were skipped; a run with fewer
                                 than ``skip_min_steps`` steps after warm-up gets AG103 at info
                                 level (its skips by cause, not a verdict) when more than
                                 ``skip_rate`` of its steps were skipped for causes other than
                                 warm-up probing, or more than half of them in all
AG104     dead layer             a layer's gradient was all exact zeros on ``dead_steps``
                                 consecutive sampled applied steps while another layer's was not
AG105     fp16 saturation        a layer's largest unscaled gradient came within
                                 ``saturation_factor`` of fp16's max (65504) without overflowing
AG106     gradient underflow     on at least half of a layer's range samples, more than
                                 ``underflow_frac`` of its nonzero gradients were below fp16's
                                 smallest normal at the scale in use
AG107     resume gap             after a resume the scale differs from the one before the
                                 interruption by ``2**resume_gap_bits`` or more, or was reset to
                                 ``init_scale`` (checkpoint without scaler state)
AG108     bf16 recommended       on ``bf16_min_samples`` range samples the safe scale window was
                                 empty: no fp16 scale keeps the small gradients and the large ones
AG109     non-finite skips       without a loss scaler, steps were skipped for non-finite
                                 gradients (error once ``max_nonfinite_skips`` ran in a row)
AG110     non-finite applied     a watched step without a scaler applied non-finite gradients
AG170     absorbed fp16 overflow fp16 ops inside a module overflowed on an applied range-sampling
                                 step (telemetry's ``absorbed`` events; ``rules._silent``)
AG171     fp16 without a scaler  no loss scaler, and a layer's gradients underflow as in AG106
                                 (replaces AG106 for such a run; ``rules._silent``)
========  =====================  ===============================================================
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ampguard.findings import Finding, count
from ampguard.rules._agree import agree
from ampguard.rules._base import TITLES, RuleConfig
from ampguard.rules._base import make_finding as _finding
from ampguard.rules._gaps import ag140
from ampguard.rules._layers import ag104, ag105, ag106, ag108
from ampguard.rules._nonfinite import ag109, ag110
from ampguard.rules._silent import ag170, ag171
from ampguard.runlog import RunLog

__all__ = ["RuleConfig", "evaluate", "warmup_mask", "skip_causes", "NONFINITE_FORWARD", "TITLES"]

NONFINITE_FORWARD = "non-finite forward (NaN/inf loss)"
"""The :func:`skip_causes` key of skipped steps whose loss was non-finite."""


def evaluate(run: RunLog, config: RuleConfig | None = None) -> list[Finding]:
    """All AG1xx findings for ``run``, most severe first, then by step."""
    cfg = config or RuleConfig()
    if not isinstance(cfg, RuleConfig):
        raise TypeError(f"config must be an ampguard.rules.RuleConfig, got {type(cfg).__name__}")
    warm = warmup_mask(run, cfg)
    found: list[Finding] = []
    for rule in (
        _ag101,
        _ag102,
        _ag103,
        ag104,
        ag105,
        ag106,
        _ag107,
        ag108,
        ag109,
        ag110,
        ag170,
        ag171,
    ):
        found.extend(rule(run, cfg, warm))
    found.extend(ag140(run, cfg, warm))  # steps a full disk kept out of the log
    # --- findings recorded during the run (forensics, distributed, attach mode) ---
    recorded = {
        (e["finding"]["code"], e["finding"]["title"]): Finding.from_dict(e["finding"])
        for e in run.events
        if e.get("kind") == "finding" and "finding" in e
    }
    found.extend(recorded.values())  # the last event per code and title wins
    # --- end of recorded findings ---
    found = agree(found)  # the scale/gradient advice follows the forensic verdict (rules._agree)
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda f: (order[f.severity], f.step or 0, f.code))


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
    loss_bad = _loss_nonfinite(run)
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


def _loss_nonfinite(run: RunLog) -> np.ndarray:
    """Per step: the window's loss was NaN/inf (False where the log has no such field)."""
    bad = run.loss_nonfinite
    return bad if len(bad) == len(run.steps) else np.zeros(len(run.steps), dtype=bool)


def _forward_share(run: RunLog, idx: np.ndarray) -> tuple[int, int]:
    """(skipped steps among ``idx`` whose loss was non-finite, skipped steps among ``idx``)."""
    skipped = idx[~run.applied[idx]]
    return int(_loss_nonfinite(run)[skipped].sum()), len(skipped)


_FORWARD_FIX = (
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


# ---------------------------------------------------------------------- scale rules
def _ag101(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
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
        forward, _ = _forward_share(run, idx)
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
                _FORWARD_FIX if forward * 2 >= len(idx) else fix,
            )
        ]
    if not sc.get("dynamic", True) or len(run.steps) == 0:
        return []
    floor = min_scale * cfg.collapse_floor_factor
    low = np.flatnonzero(run.overflow & (run.scale <= floor))
    if len(low) and float(sc.get("init_scale", 2.0**16)) > floor:
        i = int(low[0])
        forward, skipped = _forward_share(run, np.flatnonzero(run.overflow))
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
                _FORWARD_FIX if forward * 2 >= max(skipped, 1) else fix,
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
    forward, skipped = _forward_share(run, post[max(0, worst - w + 1) : worst + 1])
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
            _FORWARD_FIX if forward * 2 >= max(skipped, 1) else fix,
        )
    ]


def _ag102(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
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


def _ag103(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
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
def _ag107(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
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
