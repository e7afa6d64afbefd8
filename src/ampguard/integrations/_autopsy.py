"""``ampguard.autopsy`` on an attached run: what the framework did, as the Guard's autopsy reads it.

``ag.autopsy(handle)`` reads a :class:`~ampguard.integrations.watch.Watch` through
:meth:`AutopsySurface.autopsy_subject`, an :class:`ampguard.guard.AutopsySubject`: the watched
model and optimizers, the Guard's flight recorder on this loop (ring, spikes, snapshots and the
recorded batches), the loop's precision and what is known of its step (the clip norm a framework
reports, e.g. the HF Trainer's ``max_grad_norm``; one batch per optimizer step). The Guard's
replay then runs unchanged: from the last snapshot (``snapshot_every=N``) before the spike, each
recorded window replayed and checked against the recorded loss, then the interventions.

Where it cannot, every spike gets the mechanism read from the recorded signals with
``verified=False`` and ``evidence["replay"]`` saying why:

* **DeepSpeed**: the engine owns the forward of a converted, partitioned module (no replay
  outside it);
* **no snapshots**: attach mode takes none unless asked (``snapshot_every=N``);
* **no batch** for a window: the loop hands none (``handle.record_batch(batch, loss_fn)``; the
  HF Trainer and Lightning callbacks keep it with ``snapshot_every`` or ``signatures``), or
  ``ag.autopsy(handle, batches=..., loss_fn=...)``;
* **gradient accumulation** (HF ``gradient_accumulation_steps > 1``): one batch per window is
  kept, so the window's micro-batches are not all there;
* **torch.distributed**: each rank's batch and the reduction differ from what one process redoes.
"""

from __future__ import annotations

from typing import Any

from ampguard.guard import AutopsySubject
from ampguard.integrations._triage import NO_REPLAY

__all__ = ["AutopsySurface", "RECORD_HINT"]

RECORD_HINT = (
    "hand each batch to handle.record_batch(batch, loss_fn) before its forward (the HF Trainer "
    "and Lightning callbacks do it with snapshot_every= or signatures=), or call "
    "ag.autopsy(handle, batches=..., loss_fn=...)"
)


class AutopsySurface:
    """What ``ampguard.autopsy`` reads of a Watch (a mixin of the Watch: it reads the Watch's
    own state)."""

    source: Any
    recorder: Any
    framework: str | None
    optimizers: list[Any]
    precision: str
    #: micro-batches per optimizer step, when the framework says (HF Trainer); None: unknown,
    #: taken as one
    accumulation: int | None = None

    def autopsy_subject(self) -> AutopsySubject:
        """This run as ``ampguard.autopsy`` reads it. ``ValueError`` when nothing was recorded
        (``flight_recorder=False`` and ``on_spike=None``). Cost: none."""
        if self.recorder is None:
            raise ValueError(
                "ag.autopsy needs the flight recorder on the attached run: attach without "
                "flight_recorder=False / on_spike=None (and with snapshot_every=N for a replay)"
            )
        spikes = self.recorder.spikes
        return AutopsySubject(
            model=self.source.model,
            optimizers=self.optimizers,
            flight_recorder=spikes,
            precision=self.precision,
            device=self.source.device,
            clip_grad_norm=self.source.clip_grad_norm,
            distributed=spikes.dist,
            no_replay=self._no_replay(spikes),
            record_hint=RECORD_HINT,
            differs_hint=_differs_hint(self.source.clip_grad_norm),
            settle=self.recorder.settle,
        )

    def _no_replay(self, spikes: Any) -> str | None:
        framework = self.framework or "plain"
        if framework in NO_REPLAY:
            return f"no replay on an attached {framework} run: {NO_REPLAY[framework]}"
        if spikes.snapshots is None:
            return (
                "no snapshots: attach mode takes none unless asked; attach with "
                "snapshot_every=N (ag.watch(..., snapshot_every=N) or the callback's) so the "
                "autopsy can replay from the last one before the spike"
            )
        if self.accumulation is not None and self.accumulation > 1:
            return (
                f"gradient accumulation ({self.accumulation} micro-batches per step): attach "
                "mode keeps one batch per optimizer step, so a window cannot be replayed whole"
            )
        return None


def _differs_hint(clip: float | None) -> str:
    """What an attached loop may do that the replay does not know of."""
    clipped = "" if clip is None else f" (the framework's clip at {clip:g} is replayed)"
    return (
        ". In attach mode the replay redoes the framework's precision, loss scale and step"
        f"{clipped}; a loop's own gradient clipping, accumulation, or a loss other than "
        "loss_fn(model, batch) is not replayed"
    )
