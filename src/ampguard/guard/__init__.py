"""The Guard: one object for the whole AMP training step (``ampguard.Guard``).

Module map. ``_guard`` holds the class: its constructor (every argument checked before the
model is touched), the public properties, ``autocast`` / ``backward`` / ``step``, findings,
``close`` and the surface ampguard's own packages use (the checkpoint loader, the cross-rank
audit). The Guard keeps what its helpers share in one :class:`~ampguard.guard._step_state.StepState`
with public fields and passes it to them, so no helper reads the Guard's private attributes.
``_step`` is the one step of every precision (unscale -> clip -> optimizer step -> scale update)
over the loss-scale interface of ``ampguard.core.loss_scale`` (no-op, static, dynamic);
``_flags`` reads fused optimizers' pending step flags and counts them; ``_collapse`` is the
collapse policy (raise, warn, fall back to bf16) and ``_nonfinite`` the bound on non-finite
skips without a scale; ``_state`` the versioned state dict (check everything, then apply);
``_fp8`` builds a precision's conversion through its registry hook (fp8's torchao layers,
``ampguard.fp8._convert``); ``_forensics`` runs ``keep_fp32`` / ``forensics`` /
``auto_fallback`` / ``coverage_step`` around the step; ``_spikes`` the flight recorder and
``on_spike`` (over :mod:`ampguard.replay`), ``_recorder`` its dumps into the run folder and
``_autopsy`` ``ampguard.autopsy``, the counterfactual replay of a loss spike (its replays in
``_replay_run``, its interventions in ``_interventions``, its batches in ``_batches``). Attach
mode (``ampguard.integrations``) keeps the same flight recorder and spike policy on a loop it
watches: ``AutopsySubject`` (``_subject``) is what ``ampguard.autopsy`` reads of an attached
run, ``check_flight_recorder`` / ``attach_flight_recorder`` and ``check_signatures`` /
``attach_signatures`` are the Guard's own argument checks and factories, public for it.

>>> guard = Guard(model, optimizer, precision="fp16", clip_grad_norm=1.0)
>>> for x, y in data:
...     with guard.autocast():
...         loss = loss_fn(model(x), y)
...     guard.backward(loss)
...     result = guard.step()          # result.applied, result.overflow, result.grad_norm
"""

from ampguard.core.results import StepResult
from ampguard.guard._autopsy import SpikeDiagnosis, autopsy
from ampguard.guard._guard import Guard
from ampguard.guard._signatures import attach as attach_signatures
from ampguard.guard._signatures import check as check_signatures
from ampguard.guard._spikes import DEFAULT_CAPACITY, DEFAULT_SNAPSHOT_EVERY, SpikeConfig, SpikeWatch
from ampguard.guard._spikes import attach as attach_flight_recorder
from ampguard.guard._spikes import check as check_flight_recorder
from ampguard.guard._subject import AutopsySubject

__all__ = [
    "AutopsySubject",
    "DEFAULT_CAPACITY",
    "DEFAULT_SNAPSHOT_EVERY",
    "Guard",
    "SpikeConfig",
    "SpikeDiagnosis",
    "SpikeWatch",
    "StepResult",
    "attach_flight_recorder",
    "attach_signatures",
    "autopsy",
    "check_flight_recorder",
    "check_signatures",
]
