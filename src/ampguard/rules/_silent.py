"""Runtime rules AG170-AG171: silent precision failures (nothing non-finite reaches the step).

AG170  on range-sampling steps that applied, fp16/bf16 ops inside a module turned finite inputs
       into inf/NaN (telemetry's ``absorbed`` events, see :mod:`ampguard.telemetry._absorbed`):
       the step was applied, so a later op absorbed the inf (``x / sqrt(inf) = 0``) and the
       module's output stopped depending on its input.
AG171  an fp16 run without a loss scaler (``ag.watch(None, ..., precision="fp16")``, a
       framework's fp16 step without a GradScaler): on at least half of a layer's range
       samples more than ``underflow_frac`` of its nonzero gradients were fp16 subnormals
       (fewer than 11 significant bits; the smallest flushed to zero). Such a run gets AG171
       instead of AG106, whose fix (a larger loss scale) presumes a scaler.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ampguard.findings import Finding, count
from ampguard.rules._base import RuleConfig, fp16_mask
from ampguard.rules._base import make_finding as _finding
from ampguard.runlog import RunLog

__all__ = ["ABSORBED_EVENT", "ag170", "ag171", "no_scaler"]

ABSORBED_EVENT = "absorbed"  # events.jsonl kind: {"kind", "step", "modules": {name: ops}}
_MAX_STEPS = 20  # steps listed in evidence


def no_scaler(run: RunLog) -> bool:
    """The run had no loss scaler (a watched loop without one; a Guard always records its
    ScalerConfig, whose ``init_scale`` is missing only in attach mode without a scaler)."""
    return "init_scale" not in run.scaler_config()


def _applied_steps(run: RunLog) -> set[int]:
    return {int(s) for s, a in zip(run.steps.tolist(), run.applied.tolist(), strict=True) if a}


def ag170(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    events = [e for e in run.events if e.get("kind") == ABSORBED_EVENT]
    if not events:
        return []
    applied = _applied_steps(run)
    per_module: dict[str, dict[str, Any]] = {}
    for e in events:
        step = e.get("step")
        if step not in applied:  # a skipped step: the overflow was loud, the scaler saw it
            continue
        for module, ops in (e.get("modules") or {}).items():
            acc = per_module.setdefault(module, {"steps": [], "ops": 0})
            acc["steps"].append(int(step))
            acc["ops"] += int(ops)
    out = []
    for module, acc in sorted(per_module.items(), key=lambda kv: kv[1]["steps"][0]):
        steps = acc["steps"]
        name = "the root module ('')" if module == "" else repr(module)
        out.append(
            _finding(
                "AG170",
                "warning",
                f"{name}: fp16 ops inside it overflowed to inf on "
                f"{count(len(steps), 'sampled step')} that applied (first at step "
                f"{steps[0]}; {count(acc['ops'], 'op')} in all), yet "
                "the step's loss and gradients were finite: a later op absorbed the inf (e.g. "
                "x / sqrt(inf) = 0), so the module's output no longer depends on its input and "
                "the loss can plateau with no skipped step. ampguard.locate(model, loss_fn, "
                "batch) names the op (AG360).",
                steps[0],
                {
                    "module": module,
                    "steps": steps[:_MAX_STEPS],
                    "samples": len(steps),
                    "ops": acc["ops"],
                },
                f"Keep {name} in fp32 (Guard(..., keep_fp32=[{module!r}]) or "
                "auto_fallback=True), train in bf16 (precision='bf16'), or normalise before the "
                "op that overflows (subtract the mean and divide by the max before squaring, or "
                "use torch.nn.LayerNorm, which autocast runs in fp32). A larger or smaller loss "
                "scale does not help: the overflow is in the forward pass.",
            )
        )
    return out


def ag171(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    if not no_scaler(run):
        return []
    ok = run.range_applied & fp16_mask(run.range_precision)
    if not ok.any():
        return []
    hits_by_layer = []
    for j, name in enumerate(run.layers):
        frac = run.underflow[ok, j]
        valid = np.isfinite(frac)
        hits = valid & (frac > cfg.underflow_frac)
        if hits.any() and hits.sum() * 2 >= valid.sum():
            hits_by_layer.append((float(np.nanmedian(frac[valid])), name, j, int(valid.sum())))
    if not hits_by_layer:
        return []
    hits_by_layer.sort(reverse=True)
    share, name, j, samples = hits_by_layer[0]
    steps = run.range_steps[ok]
    zeros = float(np.nanmedian(run.zero_frac[ok, j])) if run.zero_frac.size else float("nan")
    others = [n for _, n, _, _ in hits_by_layer[1:]]
    also = (
        f" Also above {cfg.underflow_frac:.0%}: {', '.join(map(repr, others[:5]))}."
        if others
        else ""
    )
    return [
        _finding(
            "AG171",
            "warning",
            f"fp16 without a loss scaler loses {share:.1%} of layer {name!r}'s gradient: that "
            "share of its nonzero gradient elements (median over "
            f"{count(samples, 'range sample')}) is below fp16's smallest normal 6.1e-05, "
            "stored as subnormals with fewer than 11 "
            f"significant bits, the smallest flushed to zero ({zeros:.1%} of its elements are "
            "exact zeros). Nothing overflows and no step skips: the layer learns from a "
            f"coarsened, partly zeroed gradient and the loss can plateau where fp32 learns.{also}",
            int(steps[0]),
            {
                "layer": name,
                "underflow": share,
                "zero_frac": zeros,
                "samples": samples,
                "layers": [n for _, n, _, _ in hits_by_layer],
                "threshold": cfg.underflow_frac,
            },
            "Use a loss scaler: ampguard.Guard(model, optimizer, precision='fp16') (dynamic "
            "scaling), or torch.amp.GradScaler() with scaler.scale(loss).backward(); or train "
            "in bf16 (precision='bf16' / torch.autocast(dtype=torch.bfloat16)), which needs "
            "no scaler.",
        )
    ]
