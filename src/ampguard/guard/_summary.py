"""The Guard's summary of a run: ``diagnostics()``, its findings, and what ``close()`` writes.

All of it is read from what the Guard's parts already keep (the counters, the scale history,
forensics' changes and diagnoses, the stagnation probe and rescue, fp8's drift, distributed's
audits, the loss spikes); nothing is recomputed. Cost: one host sync (the pending flags, the
scale) per call; ``close`` adds the telemetry flush and the report.
"""

from __future__ import annotations

import warnings
from typing import Any

from ampguard._util.stack import user_stacklevel
from ampguard.findings import Finding
from ampguard.guard import _flags, _rescue, _signatures
from ampguard.guard._step_state import StepState
from ampguard.reporting import write_report

__all__ = ["close", "diagnostics", "findings", "side_findings"]


def diagnostics(state: StepState, last: int) -> dict[str, Any]:
    """``Guard.diagnostics(last)`` (see there). Cost: one host sync."""
    _flags.drain(state)
    c = state.counts
    history = state.history.tail(state.steps, last) if state.scaled else []
    resume = state.resume
    return {
        "step": state.steps,
        "precision": state.policy.precision,
        "scale": state.loss_scale.scale(),
        "skipped_steps": c.skipped,
        "skipped_by_cause": {
            "overflow": c.skipped_overflow,
            "collapse": c.skipped_collapse,
            "nonfinite": c.skipped_nonfinite,
            "nonfinite_forward": c.skipped_nonfinite_loss,
        },
        "applied_steps": c.applied,
        "scale_changes": state.history.changes(),
        "last_scales": [{"step": s, "scale": v} for s, v in history],
        "consecutive_skips": c.consecutive_skips,
        "microbatches_dropped": c.dropped_microbatches,
        "fallbacks": _fallbacks(state),
        "resume": dict(resume.info) if resume.info else None,
        "resume_warmup_active": resume.ramp is not None,
    }


def _fallbacks(state: StepState) -> list[dict[str, Any]]:
    changes = state.forensics.changes if state.forensics is not None else []
    if state.fp8 is not None and state.fp8.rescue is not None:  # fp8 -> bf16 rescues
        changes = [*changes, *state.fp8.rescue.changes]
    return ([dict(state.fallback)] if state.fallback else []) + [dict(c) for c in changes]


def findings(state: StepState) -> list[Finding]:
    """``Guard.findings()`` (see there). Cost: one host sync and a read of the run log."""
    side = side_findings(state)
    if state.telemetry is None:  # what forensics/fp8/distributed found; no rules to run
        if (
            state.forensics is None
            and state.dist is None
            and state.fp8 is None
            and state.stagnation is None
            and state.rescue is None
            and state.signatures is None
        ):
            warnings.warn(
                "Guard.findings(): without telemetry only forensics, fp8 and distributed "
                "findings exist (none are enabled); the AG1xx rules need a run log: create "
                "the Guard with telemetry=RUN_DIR (or an ampguard.Telemetry)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return side
    state.telemetry.record_findings(side)
    return state.telemetry.findings()


def side_findings(state: StepState) -> list[Finding]:
    """Findings made during the run (forensics AG3xx, distributed AG13x), not by the rules."""
    out = state.forensics.findings() if state.forensics is not None else []
    # AG175: bf16/fp16 weights whose updates round away; AG176/AG177: states, rescue
    out += _rescue.stagnation_findings(state.rescue, state.stagnation, state.optimizers)
    if state.fp8 is not None:  # AG111/AG112: fp8 layers drifting out of fp8's window
        out += state.fp8.findings()
    if state.dist is not None:
        out += state.dist.findings(state.steps)
    if state.spikes is not None:  # AG180: loss spikes
        out += state.spikes.findings()
    out += _signatures.findings(state.signatures)  # AG380-AG383: ampguard.triage's events
    return out


def close(state: StepState) -> None:
    """``Guard.close()`` (see there). Cost: one host sync; the report takes about a second."""
    if state.spikes is not None:  # the flight recorder's SIGTERM handler goes
        state.spikes.close()
    if state.telemetry is not None and not state.telemetry.closed:
        try:  # a collapse surfacing here (pending fused flags) still closes the run log
            state.telemetry.record_findings(side_findings(state))
            state.telemetry.annotate("diagnostics", diagnostics(state, 8))  # report header
            if state.dist is not None:
                state.telemetry.annotate("distributed", state.dist.summary())
        finally:
            state.telemetry.close()
        write_report(state.telemetry.run_dir)  # as the framework integrations do
