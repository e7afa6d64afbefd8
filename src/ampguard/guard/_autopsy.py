"""``ampguard.autopsy(guard)``: replay each loss spike with one intervention at a time.

For a spike at window ``t`` (the loss of ``t`` was computed with the weights after ``t - 1``):

1. Restore, into copies of the model, optimizers and schedulers, the last snapshot taken before
   ``t - 1`` (``Guard(snapshot_every=...)``), and replay the recorded batches
   (``guard.step(batch=..., loss_fn=...)``) up to ``t - 2``, checking every window's loss against
   the flight recorder's (the replay must reproduce the run: same RNG, LRs, loss scale).
2. From there, run windows ``t - 1`` and ``t`` once plainly (the spike must come back) and then
   once per intervention, smallest first; the first whose loss at ``t`` stays below the
   detector's bound is the verified cause:

   ===================  ==============================================  ===========================
   intervention         what changes                                    mechanism
   ===================  ==============================================  ===========================
   ``drop_outliers``    window ``t`` without its samples above 3x the   ``outlier_batch``
                        median loss (at least one, at most a quarter)
   ``floor_v``          Adam's ``exp_avg_sq`` of the suspect layer      ``adam_second_moment``
                        floored at its mean before ``t - 1``'s update
   ``clip_update``      the suspect layer's update at ``t - 1`` clipped ``attention_logit_growth``,
                        to the other layers' median update ratio        ``output_logit_divergence``
                                                                        or ``update_outlier``
   ``fp32_layer``       the suspect layer in fp32 at ``t - 1`` and      ``lowp_amax_jump``
                        ``t``
   ``halve_lr``         the LR of every group halved at ``t - 1``       ``update_outlier``
   ===================  ==============================================  ===========================

   The suspect layers are the two with the largest update-to-weight ratio at ``t - 1`` in the
   plain replay (each layer intervention is tried on both). The live model, optimizers,
   schedulers and the global RNG are left as they were.

Where no replay is possible (no batch recorded, no snapshot before the spike, gradient
accumulation, a distributed model) or it does not reproduce the run, the diagnosis says why in
its evidence and gives the mechanism read from the recorded signals, with ``verified=False``.
Cost: ``t - s + 2 * (1 + interventions)`` replayed windows (``s``: the snapshot's window) plus
one forward per sample of window ``t``; host syncs throughout (a diagnostic tool, not the hot
path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.guard._replay_run import NotApplicable, Replay, Run, interventions, plain
from ampguard.replay import Snapshot, rng_state, set_rng_state
from ampguard.reporting.postmortem import layer_kind, layer_of, signal_read

__all__ = ["MECHANISMS", "SpikeDiagnosis", "autopsy"]

MECHANISMS = (
    "outlier_batch",
    "update_outlier",
    "adam_second_moment",
    "attention_logit_growth",
    "output_logit_divergence",
    "lowp_amax_jump",
    "optimizer_state_rounding",
    "unknown",
)

FIXES = {
    "outlier_batch": "filter or re-shuffle the data around this batch (a few samples carry the "
    "loss); on_spike='skip' keeps such a batch out of the weights",
    "update_outlier": "a lower peak LR or a longer warm-up; clip the update of the named layer "
    "(or clip_grad_norm=1.0 when there is none)",
    "adam_second_moment": "Adam's eps larger (1e-6..1e-5) or beta2 lower (0.95): a parameter "
    "whose second moment decayed to ~0 takes a step of ~lr/sqrt(1-beta2) on its next gradient",
    "attention_logit_growth": "QK-norm (normalise queries and keys) or an attention logit "
    "soft-cap; a lower LR for the attention projections",
    "output_logit_divergence": "a z-loss on the output logits (1e-4 * logsumexp**2) or a logit "
    "soft-cap; weight decay on the output layer",
    "lowp_amax_jump": "keep the named layer in fp32 (Guard(keep_fp32=[layer])) or a delayed/"
    "per-block scaling recipe for it",
    "optimizer_state_rounding": "keep the optimizer state in fp32 (or Kahan/stochastic "
    "rounding for bf16 state)",
    "unknown": "no single intervention removed the spike: read the flight recorder around the "
    "step (ampguard postmortem RUN_DIR)",
}


@dataclass(frozen=True)
class SpikeDiagnosis:
    """The autopsy of one loss spike: window ``step``, the ``mechanism`` (one of
    :data:`MECHANISMS`), the ``layer`` (a module name or None), the ``evidence`` (the recorded
    and replayed losses, each intervention's result), the ``fix`` and whether a counterfactual
    replay removed the spike (``verified``)."""

    step: int
    mechanism: str
    layer: str | None
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    verified: bool = False


def autopsy(guard: Any) -> list[SpikeDiagnosis]:
    """One :class:`SpikeDiagnosis` per loss spike the Guard detected (see the module docstring).

    Raises ``ValueError`` when ``guard`` has neither a flight recorder nor spike detection
    (``flight_recorder=False, on_spike=None``). Cost: see the module docstring."""
    watch = getattr(guard, "flight_recorder", None)
    if watch is None:
        raise ValueError(
            "autopsy needs a Guard that records: create it with flight_recorder=N (the default) "
            "or an on_spike policy; this one has flight_recorder=False and on_spike=None"
        )
    guard.settle_pending()  # spikes of fused optimizers' pending windows
    saved = rng_state(guard.device.type)
    try:
        return [_diagnose(guard, watch, e.step) for e in watch.events]
    finally:
        set_rng_state(guard.device.type, saved)


# ---------------------------------------------------------------------- signals
def _last_layer(model: torch.nn.Module) -> str | None:
    names = [n for n, m in model.named_modules() if any(True for _ in m.parameters(False))]
    return names[-1] if names else None


# ---------------------------------------------------------------------- replay
def _unusable(guard: Any, watch: Any, step: int) -> tuple[str | None, Snapshot | None]:
    if guard.accumulation_steps != 1:
        return "the replay covers accumulation_steps=1 only", None
    if guard.distributed is not None:
        return "a distributed model is not replayed (each rank's batch differs)", None
    if watch.snapshots is None:
        return "no snapshots (snapshot=False)", None
    snap = watch.snapshots.for_spike(step)
    if snap is None:
        return f"no snapshot from before step {step - 1}", None
    missing = [s for s in range(snap.step + 1, step + 1) if s not in watch.batches]
    if missing:
        return (
            f"no batch recorded for step {missing[0]}: pass guard.step(batch=..., "
            "loss_fn=...) so the autopsy can replay",
            None,
        )
    return None, snap


def _diagnose(guard: Any, watch: Any, step: int) -> SpikeDiagnosis:
    rows = {r["step"]: r for r in watch.ring.rows()}
    mech, layer, evidence = signal_read(rows, watch.names, step, _last_layer(guard.model))
    row = rows.get(step, {})
    evidence.update({"loss": row.get("loss"), "bound": row.get("bound"), "level": row.get("level")})
    why, snap = _unusable(guard, watch, step)
    if why is not None or snap is None:
        evidence["replay"] = why
        return SpikeDiagnosis(step, mech, layer, evidence, FIXES[mech], False)
    rep = Replay(guard, watch, snap, rows)
    g = rep.new_guard()
    for s in range(snap.step + 1, step - 1):  # up to t - 2, checked against the recording
        got = rep.window(g, s)
        want = rows.get(s, {}).get("loss")
        if want is not None and not math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-6):
            evidence["replay"] = (
                f"the replay did not reproduce step {s}: loss {got:.6g}, recorded {want:.6g} "
                "(something outside the Guard consumes the RNG or changes the data)"
            )
            return SpikeDiagnosis(step, mech, layer, evidence, FIXES[mech], False)
    start = rep.take(step - 2)
    bound = row.get("bound")
    replayed, ratios = plain(rep, step)
    evidence["replayed_loss"] = replayed
    if bound is None or replayed <= bound:
        evidence["replay"] = f"the replay did not reproduce the spike: loss {replayed:.6g}"
        return SpikeDiagnosis(step, mech, layer, evidence, FIXES[mech], False)
    suspects = _suspects(ratios) or [layer]
    evidence["suspect_layers"] = suspects
    tried: dict[str, float] = {}
    for name, suspect, fn in _plan(rep, step, suspects, ratios):
        rep.restore(start)
        try:
            loss = fn()
        except NotApplicable as err:
            tried[name] = math.nan
            evidence.setdefault("not_applicable", {})[name] = str(err)
            continue
        tried[name] = loss
        if loss <= bound:
            evidence["interventions"] = tried
            evidence["removed_by"] = name
            mech_v, layer_v = _mechanism(name.split(":")[0], suspect, _last_layer(guard.model))
            return SpikeDiagnosis(step, mech_v, layer_v, evidence, FIXES[mech_v], True)
    evidence["interventions"] = tried
    return SpikeDiagnosis(step, mech, layer, evidence, FIXES[mech], False)


def _suspects(ratios: dict[str, float], top: int = 2) -> list[str | None]:
    """The ``top`` layers with the largest update-to-weight ratio at ``t - 1``."""
    best: dict[str, float] = {}
    for n, r in ratios.items():
        best[layer_of(n)] = max(best.get(layer_of(n), 0.0), r)
    return list(sorted(best, key=lambda k: -best[k])[:top])


def _plan(
    rep: Replay, step: int, suspects: list[str | None], ratios: dict[str, float]
) -> list[tuple[str, str | None, Run]]:
    """``(name, suspect, run)`` in the order they are tried: the data, then each layer
    intervention on each suspect, then the global LR."""
    per = [dict((n, (s, fn)) for n, fn in interventions(rep, step, s, ratios)) for s in suspects]
    out: list[tuple[str, str | None, Run]] = [("drop_outliers", None, per[0]["drop_outliers"][1])]
    for kind in ("floor_v", "clip_update", "fp32_layer"):
        for p in per:
            suspect, fn = p[kind]
            out.append((kind if len(per) == 1 else f"{kind}:{suspect}", suspect, fn))
    out.append(("halve_lr", suspects[0], per[0]["halve_lr"][1]))
    return out


def _mechanism(name: str, suspect: str | None, last: str | None) -> tuple[str, str | None]:
    if name == "drop_outliers":
        return "outlier_batch", None
    if name == "floor_v":
        return "adam_second_moment", suspect
    if name == "clip_update":
        return layer_kind(suspect, last), suspect
    if name == "fp32_layer":
        return "lowp_amax_jump", suspect
    return "update_outlier", suspect


SpikeDiagnosis.__module__ = "ampguard.guard"  # its public home: repr and pickles name that path
