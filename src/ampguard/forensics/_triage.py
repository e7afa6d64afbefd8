"""Hardware or math: decide a failed step's cause by deterministic replay.

For a failed step (its signatures recorded by a :class:`SignatureRecorder`), from the state the
step started from:

1. the step is replayed on the same device at the same precision and loss scale. Signatures
   that differ from the record mean the first run computed something the replay does not: a
   **transient fault**, at the first module where they part (:func:`first_difference`);
2. a replay that reproduces the record bit for bit is checked module by module against a
   reference (:func:`reference_check`: each module re-run on the CPU from the device's own
   inputs). A module that computes wrong from right inputs every time is a **persistent
   fault**; the op is found by :func:`bisect_op`. A failed step whose batch or weights already
   held a NaN/inf is explained by them: it is not reference-checked (its replay copies
   nothing), and goes on to 3;
3. otherwise the step is replayed in fp32: when it still fails, the cause is the **model or
   data**; when it does not, it is **numerics** (the low precision), and ``locate``'s
   :class:`Diagnosis` of the batch is attached.

The replays themselves are :mod:`ampguard.forensics._triage_runs`'s; what an event is once
decided, :mod:`ampguard.forensics._triage_event`'s.

Under DDP every rank triages its own replay, a peer replays its batch too
(:mod:`ampguard.forensics._triage_peer`: a rank whose record a peer does not reproduce computes
wrongly), and the verdicts are gathered, so each rank reports the same events with the faulty
rank named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampguard.core.policy import device_of, resolve_precision
from ampguard.forensics._faultcheck import bisect_op, reference_check
from ampguard.forensics._limits import FULL
from ampguard.forensics._replay import Preserved
from ampguard.forensics._signatures import SignatureRecorder, StepSignature
from ampguard.forensics._triage_audit import audit_steps, explain_audit
from ampguard.forensics._triage_event import (
    CAUSES,
    CODES,
    TriageEvent,
    gathered,
    write_events,
)
from ampguard.forensics._triage_peer import exchange, judge
from ampguard.forensics._triage_plan import agreed, failed, plan, signature
from ampguard.forensics._triage_runs import (
    compare,
    explained,
    first_bad_module,
    fp32_failed,
    run,
)

__all__ = ["CAUSES", "CODES", "TriageEvent", "triage", "triage_step"]

_NOT_PRECISION = ("model_nonfinite", "input_nonfinite")


def triage_step(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    recorded: StepSignature,
    *,
    precision: str,
    scale: float = 1.0,
    rng_state: dict[str, Any] | None = None,
    rank: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
) -> TriageEvent:
    """Decide why ``recorded``'s step failed, replaying it from the model's current state.

    ``model`` must hold the state the step started from (a skipped step leaves it so, or a
    snapshot restored it); ``batch`` and ``loss_fn(model, batch)`` are the step's;
    ``precision`` and ``scale`` what it ran with; ``rng_state`` the RNG at its forward
    (:meth:`SignatureRecorder.rng_state`). Parameters, buffers, gradients, RNG and modes are
    as before afterwards.

    A *silent* failure (nothing non-finite in the record, the replay or fp32: a spike, an
    audit mismatch, a step named by ``step=``) reproduces as numerics when ``locate`` finds the
    low precision at fault in it (an underflow, an absorbed overflow; with ``optimizer``, the
    one training ``model``, also updates that round away or an eps that underflows); else it is
    model or data.

    Cost, in passes (a pass: one forward+backward of the step): one replay at the step's
    precision, its signatures recorded and every leaf's inputs, outputs and gradients copied
    (a transient fault ends here; a batch or weights holding NaN/inf: no copies); when it
    reproduces, the CPU reference of every leaf module (about one pass, module by module),
    skipped when the batch or weights explain the failure; then one fp32 replay (no
    signatures; model or data ends here); numerics adds ``locate``'s two to five traced
    passes (each a few passes' worth: every op's output reduced), which name the event's
    ``module`` and ``op``. A persistent fault adds one re-execution of its module with every op
    run twice. Measured (fault zoo, CPU time, median step-equivalents, HF GPT-2 2 x 128 / a
    sub-millisecond MLP): transient 1.8 / 2.7, persistent 2.9 / 4.9, model or data 2.9 (an inf
    weight) / 5-9, numerics - / about 31 (``locate`` 13-24 of it). Host syncs throughout: this
    runs after a failure, not per step.
    """
    from ampguard.forensics._locate import locate

    policy = resolve_precision(precision, device_of(model.parameters()))
    keep = Preserved(model, rng_state)
    try:
        keep.reset()
        # a NaN/inf already in the batch or the weights explains a failed replay: it needs no
        # reference check, so its replay keeps no copies, only the first leaf that output one
        why = explained(model, batch)
        # one replay, signatures recorded and every leaf's inputs, outputs and gradients kept:
        # a transient fault is decided by its signatures, the reference check reads the rest
        low = run(model, loss_fn, batch, policy, scale, capture=why is None, watch=True)
        evidence: dict[str, Any] = {
            "precision": policy.precision,
            "scale": scale,
            "recorded_failed": recorded.bad,
            "replay_failed": low.bad,
            "replay_loss": low.loss,
        }
        diff = compare(recorded, low)
        if diff is not None:
            phase, module, what = diff
            evidence.update(reproduced=False, first_difference=what, replays=1)
            return TriageEvent(
                recorded.step, "transient_fault", module, None, rank, evidence, phase
            )
        evidence["reproduced"] = True
        if why is not None and not low.bad:  # finite after all: checked in full
            keep.reset()
            low, why = run(model, loss_fn, batch, policy, scale, capture=True), None
        if why is None:
            assert low.captures is not None
            deviation = reference_check(model, low.captures, policy)
            if deviation is not None:
                op, how = bisect_op(model, deviation, policy)
                evidence.update(
                    reference="cpu", deviates=deviation.what, op_found_by=how, replays=2
                )
                return TriageEvent(
                    recorded.step,
                    "persistent_fault",
                    deviation.module,
                    op,
                    rank,
                    evidence,
                    deviation.phase,
                )
        else:
            evidence["explained_by"] = why  # "batch" | "weights": no reference check
        keep.reset()
        fp32_bad, fp32_loss = fp32_failed(
            model, loss_fn, batch, resolve_precision(FULL, policy.device_type)
        )
        evidence.update(fp32_failed=fp32_bad, fp32_loss=fp32_loss, replays=3 if why is None else 2)
        failed = recorded.bad or low.bad
        evidence["silent"] = not (failed or fp32_bad)
        if fp32_bad or policy.dtype is None:
            culprit = first_bad_module(low)
            return TriageEvent(
                recorded.step, "model_or_data", culprit, None, rank, evidence, "forward"
            )
        keep.reset()
        diag = locate(
            model,
            loss_fn,
            batch,
            policy.precision,
            scale,
            optimizer=optimizer if not failed else None,
            rng_state=rng_state,
        )
        evidence["diagnosis"] = diag.kind
        if not failed and (diag.ok or diag.benign or diag.kind in _NOT_PRECISION):
            # silent, and the low precision is not to blame: the model or the data
            return TriageEvent(recorded.step, "model_or_data", None, None, rank, evidence)
        return TriageEvent(
            recorded.step, "numerics", diag.module, diag.op, rank, evidence, diag.phase, diag
        )
    finally:
        keep.close()


def triage(
    guard: Any,
    *,
    recorder: SignatureRecorder | None = None,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    batch: Any = None,
    step: int | None = None,
    restore: Callable[[int], None] | None = None,
) -> list[TriageEvent]:
    """One :class:`TriageEvent` per failed step of ``guard``'s run that can be replayed.

    ``recorder``: the :class:`SignatureRecorder` attached to the model before the steps
    (default: the Guard's own, ``Guard(signatures=True)``; or
    ``SignatureRecorder(model, clock=lambda: guard.steps)``). Failed steps: the recorded steps
    whose loss, outputs or gradients held NaN/inf, those whose loss the Guard's flight
    recorder saw non-finite or spiking, and those whose end the DDP audit found the replicas'
    checksums apart at (``guard.distributed.mismatches``:
    :mod:`ampguard.forensics._triage_audit`); ``step=`` names one instead. A step is numbered by
    ``guard.steps`` during its forward (its ``StepResult.step`` minus one).

    Each step is replayed from the state it started from: the flight recorder's snapshot taken
    just before it (``Guard(snapshot_every=1)``), or ``restore(step)`` (your own snapshot's
    restore), or, for the latest step when it was skipped, the model as it is. Its batch and
    ``loss_fn`` come from ``guard.step(batch=..., loss_fn=...)`` (the flight recorder keeps
    them) or from ``batch=`` / ``loss_fn=``. The model, its gradients and the RNG are left as
    they were. No failed step: ``[]``. Under ``torch.distributed`` every rank must call it (a
    collective); all return the same events, with the faulty rank named. Each event is kept
    on the recorder (``recorder.events``), so ``guard.findings()`` lists it (AG380-AG383),
    also after ``guard.close()``, and written to ``RUN_DIR/triage/rank<R>.json`` for
    ``ampguard postmortem``.

    Cost: per event, see :func:`triage_step` (one to five step-equivalents for a fault or a
    model/data bug, tens for numerics, whose ``locate`` traces every op; host syncs); nothing
    on the training path.
    """
    if recorder is None:
        recorder = getattr(guard, "signatures", None)
    if recorder is None:
        raise ValueError(
            "ag.triage needs the step's signatures: create the Guard with signatures=True (or "
            "pass recorder=, an ampguard.SignatureRecorder attached before the failed step)"
        )
    if not isinstance(recorder, SignatureRecorder):
        raise TypeError(f"recorder must be a SignatureRecorder, got {type(recorder).__name__}")
    watch = getattr(guard, "flight_recorder", None)
    if step is not None and signature(recorder, watch, step) is None:
        raise ValueError(
            f"step={step} is not recorded (the recorder holds {recorder.steps}) nor in the "
            "flight recorder's ring with its RNG state"
        )
    audits = audit_steps(guard)
    failed_steps = failed(recorder, watch) + [s for s in audits if signature(recorder, watch, s)]
    steps = [step] if step is not None else agreed(sorted(set(failed_steps)))
    events = []
    for s in steps:
        todo = plan(guard, watch, recorder, s, loss_fn, batch, restore, single=step is not None)
        event = _triage_one(guard, recorder, watch, s, *todo) if todo is not None else None
        if _distributed():  # a peer replays this rank's batch (collectives: every rank)
            event = _peer(guard, recorder, watch, s, todo, event)
        if event is not None:
            events.append(event)
    merged = gathered(events)
    merged = [
        explain_audit(e, audits[e.step], guard.model) if e.step in audits else e for e in merged
    ]
    if merged:
        own = getattr(guard, "signatures", None)
        for rec in (recorder,) if own is None or own is recorder else (recorder, own):
            rec.events.update((e.step, e) for e in merged)  # guard.findings() lists them
        run_dir = getattr(getattr(guard, "telemetry", None), "run_dir", None)
        write_events(run_dir, _rank(), merged)
    return merged


def _triage_one(
    guard: Any,
    recorder: SignatureRecorder,
    watch: Any,
    step: int,
    loss_fn: Any,
    batch: Any,
    restore: Callable[[int], None] | None,
) -> TriageEvent:
    model = recorder.model
    live = Preserved(guard.model) if restore is not None else None
    recorder.paused = True
    try:
        recorded = signature(recorder, watch, step)
        assert recorded is not None  # _failed and step= kept only such steps
        if restore is not None:
            restore(step)
        return triage_step(
            model,
            loss_fn,
            batch,
            recorded,
            precision=guard.precision,
            scale=float(guard.scale_used_at(step + 1)),
            rng_state=recorder.rng_state(step),
            rank=_rank(),
            optimizer=next(iter(getattr(guard, "optimizers", None) or []), None),
        )
    finally:
        recorder.paused = False
        if live is not None:
            live.close()


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _peer(
    guard: Any,
    recorder: SignatureRecorder,
    watch: Any,
    step: int,
    plan: tuple[Any, Any, Callable[[int], None] | None] | None,
    event: TriageEvent | None,
) -> TriageEvent | None:
    """``event`` judged with a peer's replay of this rank's batch (:mod:`._triage_peer`)."""
    import torch.distributed as dist

    mine, replay = None, None
    if plan is not None and event is not None:
        loss_fn, batch, restore = plan
        recorded = signature(recorder, watch, step)
        mine = (
            None
            if recorded is None
            else {"batch": batch, "signature": recorded, "rng": recorder.rng_state(step)}
        )
        model = recorder.model
        scale = float(guard.scale_used_at(step + 1))
        policy = resolve_precision(guard.precision, device_of(model.parameters()))

        def replay(peer_batch: Any, signature: StepSignature, rng: Any) -> Any:
            live = Preserved(guard.model) if restore is not None else None
            recorder.paused = True
            try:
                if restore is not None:
                    restore(step)
                keep = Preserved(model, rng)
                try:
                    keep.reset()
                    replayed = run(model, loss_fn, peer_batch, policy, scale, capture=False)
                finally:
                    keep.close()
                return compare(signature, replayed)
            finally:
                recorder.paused = False
                if live is not None:
                    live.close()

    device = next((p.device for p in recorder.model.parameters()), torch.device("cpu"))
    differs = exchange(mine, replay if mine is not None else None, device)
    if event is None:
        return None
    return judge(event, differs, dist.get_rank(), dist.get_world_size())


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
