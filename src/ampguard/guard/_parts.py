"""The Guard's parts, built from its checked :class:`~ampguard.guard._config.GuardConfig`.

Steps 2 and 3 of the Guard's all-or-nothing construction (step 1 is
:func:`ampguard.guard._config.check`): :func:`step_state` makes the step state (loss scale,
scale history, buffer snapshots, resume tracker); :func:`attach` creates the resources (the
peer group, the run folder) and only then touches the model (fp8 layers, keep_fp32 hooks,
the stagnation rescue, signature hooks). A failure while touching the model undoes what was
done and releases the run folder, so the model is as it was. Cost: no host sync.
"""

from __future__ import annotations

from typing import Protocol

from ampguard.core.buffer_restore import BufferSnapshot
from ampguard.core.loss_scale import make_loss_scale
from ampguard.core.resume import ResumeTracker
from ampguard.core.scale_history import ScaleHistory
from ampguard.distributed import attach as attach_distributed
from ampguard.distributed import rank_telemetry
from ampguard.guard import _forensics as guard_forensics
from ampguard.guard import _rescue, _signatures, _spikes
from ampguard.guard._config import GuardConfig
from ampguard.guard._step_state import StepState
from ampguard.telemetry import TelemetrySource
from ampguard.telemetry import attach as attach_telemetry

__all__ = ["Host", "attach", "step_state"]


class Host(guard_forensics.ForensicsHost, TelemetrySource, Protocol):
    """What :func:`attach` reads of the Guard being built: forensics' and telemetry's surface."""


def step_state(config: GuardConfig) -> StepState:
    """The step state of a new Guard (nothing attached yet). Cost: no host sync."""
    c = config
    # the buffers a forward updates (fp8's swap to Float8Linear in step 3 adds none)
    buffers = BufferSnapshot.of(c.model) if c.restore_buffers_on_skip else None
    return StepState(
        model=c.model,
        optimizers=c.optimizers,
        params=c.params,
        device=c.device,
        config=c.scaler,
        accumulation_steps=c.accumulation_steps,
        clip_grad_norm=c.clip_grad_norm,
        skip_nonfinite=c.skip_nonfinite,
        contain_microbatches=c.contain_microbatches,
        requested_precision=c.requested_precision,
        policy=c.policy,
        loss_scale=make_loss_scale(c.policy.entry.loss_scale, c.scaler, c.device),
        history=ScaleHistory(c.scaler.init_scale if c.policy.needs_scaler else 1.0, c.device),
        resume=ResumeTracker(c.resume_warmup),
        fp8=c.conversion,
        stagnation=c.stagnation,
        buffer_snapshot=buffers,
        # containment: a dropped micro-batch's forward is undone too (one more snapshot)
        micro_snapshot=(
            BufferSnapshot.of(c.model) if buffers is not None and c.contain_microbatches else None
        ),
    )


def attach(guard: Host, state: StepState, config: GuardConfig) -> None:
    """Attach distributed, the flight recorder, telemetry, then the model's parts to ``state``.

    ``guard``: the Guard being built (telemetry and forensics read it). Raises what an attach
    raises, after undoing the model's parts and releasing the run folder. Cost: no host sync.
    """
    c = config
    # 2. distributed (ampguard.distributed): None unless a process group is in play;
    # ampguard's own collectives wait at most peer_timeout seconds (distributed._peers)
    state.dist = attach_distributed(
        c.model,
        c.device,
        audit_every=c.audit_every,
        on_desync=c.on_desync,
        process_group=c.process_group,
        containment=state.contain_microbatches,
        params=c.params,
        peer_timeout=c.peer_timeout,
    )
    # the flight recorder and on_spike (ampguard.guard._spikes): None when both are off
    state.spikes = _spikes.attach(c.spikes, state, c.schedulers, c.telemetry)
    telemetry = rank_telemetry(state.dist, c.telemetry)  # distributed: rank 0 writes the log
    # telemetry (ampguard.telemetry): device-side step records, flushed every N steps; the
    # run folder is created and locked here (TelemetryError naming it if it cannot be)
    state.telemetry = attach_telemetry(telemetry, guard)
    conversion = c.conversion
    try:  # 3. the model
        if conversion is not None:
            conversion.convert()
            # fp8 telemetry: per-layer amax and flushed shares; with auto_fallback a layer
            # drifting out of fp8's window moves back to bf16 (ampguard.fp8._rescue)
            conversion.watch(state.telemetry, state, rescue=c.auto_fallback)
        # forensics (ampguard.guard._forensics): keep_fp32 islands, armed tracing,
        # auto_fallback, coverage_step; None (zero cost) unless one of them is used
        state.forensics = guard_forensics.attach(
            guard,
            keep_fp32=c.keep_fp32,
            forensics=c.forensics,
            auto_fallback=c.auto_fallback,
            coverage_step=c.coverage_step,
        )
        # stagnation rescue: fp32 steps of bf16/fp16 weights, EMA watches (guard._rescue)
        state.rescue = _rescue.attach(c.model, c.optimizers, c.params, c.rescue)
    except BaseException:
        if state.rescue is not None:
            state.rescue.close()
        if conversion is not None:
            conversion.revert()
        if state.telemetry is not None:
            state.telemetry.release()
        raise
    # sync-free signatures for ampguard.triage (ampguard.guard._signatures); last: hooks
    state.signatures = _signatures.attach(
        c.model, c.signatures_every, lambda: state.steps, state.spikes is not None
    )
