"""Per-layer and range rules: AG104 dead layer, AG105 saturation, AG106 underflow, AG108 bf16."""

from __future__ import annotations

import numpy as np

from ampguard.findings import Finding
from ampguard.rules._base import RuleConfig, fp16_mask
from ampguard.rules._base import make_finding as _finding
from ampguard.rules._ranges import FP16_MAX
from ampguard.rules._silent import no_scaler
from ampguard.runlog import RunLog

__all__ = ["ag104", "ag105", "ag106", "ag108"]


# ---------------------------------------------------------------------- layer rules
def ag104(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    ok = run.layer_applied & np.isfinite(run.layer_norm).all(axis=1)
    if ok.sum() < cfg.dead_steps or run.layer_norm.shape[1] < 2:
        return []
    steps = run.layer_steps[ok]
    dead = run.layer_norm[ok] == 0  # a zero norm: every element is exactly zero
    out = []
    for j, name in enumerate(run.layers):
        others_alive = (~np.delete(dead, j, axis=1)).any(axis=1)
        start, length = _longest_run(dead[:, j] & others_alive)
        if length < cfg.dead_steps:
            continue
        first, last = int(steps[start]), int(steps[start + length - 1])
        numel = run.meta.get("layers", {}).get("numel", [None] * len(run.layers))[j]
        out.append(
            _finding(
                "AG104",
                "warning",
                f"layer {name!r} got all-zero gradients on {length} consecutive sampled steps "
                f"({first}-{last}) while other layers learned: it is not training (the loss can "
                "still move through the other layers).",
                first,
                {
                    "layer": name,
                    "first_step": first,
                    "last_step": last,
                    "samples": length,
                    "numel": numel,
                },
                f"Check what blocks the gradient into {name!r}: a saturated sigmoid/tanh gate "
                "(its derivative rounds to 0 in fp16; keep the gate in fp32), a branch whose "
                "weights are all zero-initialised, a detach() or a ReLU that is always off. If the "
                "layer is frozen on purpose, set requires_grad=False and leave it out of the "
                "optimizer.",
            )
        )
    return out


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    best, best_start, start = 0, 0, None
    for i, m in enumerate([*mask.tolist(), False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            if i - start > best:
                best, best_start = i - start, start
            start = None
    return best_start, best


def _range_ok(run: RunLog) -> np.ndarray:
    return run.range_applied & fp16_mask(run.range_precision)


def ag105(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    ok = _range_ok(run)
    limit = FP16_MAX / cfg.saturation_factor
    out = []
    for j, name in enumerate(run.layers):
        amax = np.where(ok, run.amax[:, j], np.nan) if len(ok) else np.zeros(0)
        hits = np.flatnonzero(amax >= limit)
        if not len(hits):
            continue
        worst = int(hits[np.argmax(amax[hits])])
        step = int(run.range_steps[hits[0]])
        out.append(
            _finding(
                "AG105",
                "warning",
                f"layer {name!r}: unscaled gradients reach {amax[worst]:.4g}, within "
                f"{FP16_MAX / amax[worst]:.3g}x of fp16's max 65504 without overflowing (first at "
                f"step {step}); fp16 holds them only at loss scales <= "
                f"{FP16_MAX / amax[worst]:.3g},"
                " where small gradients underflow.",
                step,
                {
                    "layer": name,
                    "amax": amax[worst],
                    "steps": run.range_steps[hits[:20]].tolist(),
                    "fp16_max": FP16_MAX,
                },
                f"Keep {name!r} in fp32 (ampguard.forensics.islands.keep_fp32(model, [{name!r}])), "
                "normalise its inputs or "
                "lower the learning rate / clip gradients; or use precision='bf16'.",
            )
        )
    return out


def ag106(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    ok = _range_ok(run)
    if not ok.any() or no_scaler(run):  # without a scaler: AG171 (rules._silent) says it
        return []
    out = []
    for j, name in enumerate(run.layers):
        frac = run.underflow[ok, j]
        valid = np.isfinite(frac)
        hits = valid & (frac > cfg.underflow_frac)
        if not hits.any() or hits.sum() * 2 < valid.sum():
            continue
        k = int(np.argmax(np.where(hits, frac, -1.0)))
        steps, scales, lo = run.range_steps[ok], run.range_scale[ok], run.safe_lo[ok, j]
        out.append(
            _finding(
                "AG106",
                "warning",
                f"layer {name!r}: {frac[k]:.1%} of its nonzero unscaled gradients fall below "
                "fp16's "
                f"smallest normal (6.1e-05) at loss scale {scales[k]:g} (step {int(steps[k])}; "
                f"{int(hits.sum())} of {int(valid.sum())} samples above {cfg.underflow_frac:.0%}): "
                "they become subnormal or zero in the fp16 backward.",
                int(steps[k]),
                {
                    "layer": name,
                    "underflow": frac[k],
                    "scale": scales[k],
                    "safe_lo": lo[k],
                    "samples": int(valid.sum()),
                    "samples_above": int(hits.sum()),
                },
                f"Use a larger loss scale: at least {lo[k]:g} keeps 99.9% of this layer's "
                "gradients "
                f"(ScalerConfig(init_scale={lo[k]:g}, min_scale={lo[k]:g})); with a fixed scale, "
                "switch to dynamic scaling; or use precision='bf16'.",
            )
        )
    return out


def ag108(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    ok = _range_ok(run)
    lo, hi = run.window[:, 0], run.window[:, 1]
    with np.errstate(invalid="ignore"):
        empty = ok & np.isfinite(lo) & np.isfinite(hi) & (lo > hi)
    if empty.sum() < min(cfg.bf16_min_samples, max(int(ok.sum()), 1)) or not empty.any():
        return []
    k = int(np.flatnonzero(empty)[0])
    step = int(run.range_steps[k])
    return [
        _finding(
            "AG108",
            "warning",
            f"the gradients' dynamic range is wider than fp16 can hold at any loss scale on "
            f"{int(empty.sum())} of {int(ok.sum())} range samples: at step {step} keeping 99.9% of "
            f"them above fp16's smallest normal needs scale >= {lo[k]:g}, keeping the largest "
            "below "
            f"65504 needs scale <= {hi[k]:g}.",
            step,
            {
                "samples_empty": int(empty.sum()),
                "samples": int(ok.sum()),
                "safe_lo": lo[k],
                "safe_hi": hi[k],
                "steps": run.range_steps[empty][:20].tolist(),
            },
            "Train in bf16 (precision='bf16': fp32's range, no loss scale needed), or keep the "
            "layers with the largest gradients in fp32.",
        )
    ]
