"""Attach-mode findings (AG120-AG122), next to the AG101-AG108 rules over the run log.

- AG120 the framework's skipped-step flag disagrees with what the scaler did (e.g. Accelerate /
  HF Trainer with a fused optimizer: the step was skipped but reported as applied, so the LR
  scheduler advanced on a skipped step).
- AG121 attach-mode guard features changed the scale (hysteresis absorbed an overflow, the floor
  or the cap held it): the run's numbers differ from the bare scaler's at those steps.
- AG122 fp16 was requested but the framework runs without loss scaling or autocast on this
  device (made by the integrations, which know what was requested).
"""

from __future__ import annotations

from typing import Any

from ampguard import runlog
from ampguard.findings import Finding, count, make

__all__ = ["attach_findings", "fp16_inactive"]

_MAX_STEPS = 20  # steps listed in evidence


def attach_findings(watch: Any) -> list[Finding]:
    """Findings of one :class:`Watch` (after the telemetry was flushed). Cost: one host sync."""
    out = watch.added_findings
    flags = watch.framework_skip_flags
    if flags:
        out.extend(_skip_flag_mismatch(watch, flags))
    if watch.policy.active:
        out.extend(_interventions(watch))
    if watch.stagnation is not None:  # AG175: bf16/fp16 weights whose updates round away
        out.extend(watch.stagnation.findings())
    for ema in getattr(
        watch, "emas", ()
    ):  # AG175: EMA / teacher weights the optimizer does not own
        out.extend(ema.findings())
    recorder = getattr(watch, "recorder", None)
    if recorder is not None:  # AG180: loss spikes (the Guard's flight recorder)
        out.extend(recorder.findings())
    return out


def _skip_flag_mismatch(watch: Any, flags: dict[int, bool]) -> list[Finding]:
    run = runlog.load_run(watch.run_dir)
    truth = {int(s): not bool(a) for s, a in zip(run.steps, run.applied, strict=True)}
    missed = sorted(s for s, skipped in flags.items() if truth.get(s) is True and not skipped)
    invented = sorted(s for s, skipped in flags.items() if truth.get(s) is False and skipped)
    name = watch.framework or "the framework"
    out = []
    if missed:
        out.append(
            make(
                "AG120",
                detail="skipped steps reported as applied",
                message=(
                    f"{count(len(missed), 'optimizer step')} "
                    f"{'was' if len(missed) == 1 else 'were'} skipped by the GradScaler "
                    f"(non-finite gradients) but {name} reported "
                    f"{'it' if len(missed) == 1 else 'them'} as applied. With a fused optimizer "
                    "GradScaler calls optimizer.step() even when it skips (the kernel skips "
                    f"itself), and {name} takes 'step() was called' to mean 'applied', so its "
                    "LR scheduler and step counters advanced on skipped steps."
                ),
                step=missed[0],
                evidence={"steps": missed[:_MAX_STEPS], "count": len(missed), "framework": name},
                fix=(
                    "Gate the scheduler on ampguard's record (events.jsonl 'applied') or use a "
                    "non-fused optimizer (fused=False) until the framework reads found_inf; "
                    "ampguard's run log and report already count these steps as skipped."
                ),
            )
        )
    if invented:
        out.append(
            make(
                "AG120",
                detail="applied steps reported as skipped",
                message=(
                    f"{count(len(invented), 'optimizer step')} "
                    f"{'was' if len(invented) == 1 else 'were'} applied but {name} reported "
                    f"{'it' if len(invented) == 1 else 'them'} as skipped, so its LR scheduler "
                    "did not advance there."
                ),
                step=invented[0],
                evidence={
                    "steps": invented[:_MAX_STEPS],
                    "count": len(invented),
                    "framework": name,
                },
                fix="Trust ampguard's run log for skipped steps; report the mismatch upstream.",
            )
        )
    return out


def _interventions(watch: Any) -> list[Finding]:
    counts, first = watch.interventions()
    if not any(counts):
        return []
    pol = watch.policy
    parts = []
    for n, (noun, what) in zip(
        counts,
        (
            ("overflow", f"absorbed by hysteresis={pol.hysteresis}"),
            ("backoff", f"stopped at min_scale={pol.min_scale}"),
            ("growth", f"held at max_scale={pol.max_scale}"),
        ),
        strict=True,
    ):
        if n:
            parts.append(f"{count(n, noun)} {what}")
    steps = [s for s in first if s > 0]
    return [
        make(
            "AG121",
            message=(
                "The scale differs from what the bare GradScaler would have set: "
                + "; ".join(parts)
                + ". Parameters stay identical on every other step."
            ),
            step=min(steps) if steps else None,
            evidence={
                "absorbed": counts[0],
                "floored": counts[1],
                "capped": counts[2],
                "first_step": {"absorbed": first[0], "floored": first[1], "capped": first[2]},
                "policy": pol.to_dict(),
            },
            fix=(
                "Nothing to do if intended. Frequent floor hits mean fp16 cannot hold these "
                "gradients: consider bf16 or keeping the overflowing module in fp32."
            ),
        )
    ]


def fp16_inactive(framework: str, detail: str, actual: str = "fp32") -> Finding:
    """AG122: fp16 requested, but the framework runs without loss scaling/autocast
    (``actual``: the precision it trains in instead)."""
    return make(
        "AG122",
        message=(
            f"{framework} was asked for fp16 mixed precision but runs without a loss scaler "
            f"and without fp16 autocast on this device ({detail}): training is {actual}."
        ),
        evidence={"framework": framework, "detail": detail, "actual": actual},
        fix=(
            "Use bf16 on this device (bf16=True / precision='bf16-mixed'), or run on a device "
            "where the framework supports fp16 autocast with a GradScaler."
        ),
    )
