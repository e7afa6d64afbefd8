"""``ampguard.autopsy(guard)``: replay each loss spike with one intervention at a time.

For a spike at window ``t`` (the loss of ``t`` was computed with the weights after ``t - 1``):

1. Restore, into copies of the model, optimizers and schedulers, the last snapshot taken before
   ``t - 1`` (``Guard(snapshot_every=...)``), and replay the recorded windows as the Guard saw
   them (every micro-batch of ``accumulation_steps``, the recorded LRs, the loss scale) up to
   ``t - 2``, checking every window's loss against the flight recorder's.
2. Run windows ``t - 1`` and ``t`` once plainly: both replayed losses must equal the recorded
   ones (relative 1e-3), else nothing is verified and the evidence says which step differed.
3. Ask whether the data or the update at ``t - 1`` carries the spike: window ``t``'s loss at
   the weights from before ``t - 1``'s update (``evidence["loss_before_update"]``). Above the
   detector's bound, the batch is the suspect (``drop_outliers`` is tried first); under it, the
   update is, and dropping samples is not tried (it lowers any loss a little and would name the
   batch for a spike the update made).
4. Then once per intervention (:mod:`ampguard.guard._interventions`), smallest first; the first
   that removes the spike is the verified cause. *Removes* has a margin, so that a verdict does
   not flip on noise: the loss at ``t`` back within half (in log) of the band between the
   running level and the detector's bound (about 3 of its 6 noise units), not just under it:

   ===================  ==========================================  ===========================
   intervention         tried on                                    mechanism
   ===================  ==========================================  ===========================
   ``drop_outliers``    the batch, when it is the suspect           ``outlier_batch``
   ``fp32_states``      every bf16/fp16 optimizer state             ``optimizer_state_rounding``
   ``floor_v``          each suspect layer, then all outlier        ``adam_second_moment``
                        layers together
   ``clip_update``      each suspect layer, then all outlier        ``attention_logit_growth``
                        layers together                             (a query/key projection),
                                                                    ``output_logit_divergence``
                                                                    (the output layer) or
                                                                    ``update_outlier``
   ``fp32_layer``       each suspect layer                          ``lowp_amax_jump``
   ``halve_lr``         every group                                 ``update_outlier``
   ===================  ==========================================  ===========================

   The suspect layers are the two with the largest update-to-weight ratio at ``t - 1`` in the
   plain replay; the outlier layers those whose ratio is at least 10x the median layer's. The
   live model, optimizers, schedulers and the global RNG are left as they were.

Where no replay is possible (no batch recorded for a window or a micro-batch, no snapshot before
the spike, a distributed model) or it does not reproduce the run, the diagnosis says why in
``evidence["replay"]`` and gives the mechanism read from the recorded signals, with
``verified=False``. Cost: ``t - s + 2 * (2 + interventions)`` replayed windows (``s``: the
snapshot's window) plus one forward per sample of window ``t``; host syncs throughout (a
diagnostic tool, not the hot path).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.guard import _batches
from ampguard.guard._interventions import interventions, low_precision_states
from ampguard.guard._replay_run import NotApplicable, Replay, plain
from ampguard.guard._subject import GUARD_RECORD_HINT, subject_of
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


def autopsy(
    guard: Any,
    *,
    batches: Callable[[int], Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> list[SpikeDiagnosis]:
    """One :class:`SpikeDiagnosis` per loss spike the Guard detected (see the module docstring).

    Args:
        guard: The Guard of the run (with its flight recorder), or an attach handle
            (``ag.watch``'s, a framework callback's ``.watch``): read through its
            ``autopsy_subject()`` (:class:`ampguard.guard._subject.AutopsySubject`).
        batches: A batch provider for windows the Guard did not record (no
            ``guard.step(batch=...)``): ``batches(step)`` returns window ``step``'s batch (a list
            of its micro-batches with ``accumulation_steps > 1``), what the run trained on.
        loss_fn: ``loss_fn(model, batch) -> loss``, the run's; required with ``batches``.

    Raises ``ValueError`` when ``guard`` has neither a flight recorder nor spike detection
    (``flight_recorder=False, on_spike=None``) and ``TypeError``/``ValueError`` naming
    ``batches``/``loss_fn`` for a bad provider; nothing is replayed then. Cost: see the module
    docstring."""
    guard = subject_of(guard)
    watch = getattr(guard, "flight_recorder", None)
    if watch is None:
        raise ValueError(
            "autopsy needs a Guard that records: create it with flight_recorder=N (the default) "
            "or an on_spike policy; this one has flight_recorder=False and on_spike=None"
        )
    _batches.check(batches, loss_fn)
    source = _batches.Batches(watch.batches, batches, loss_fn, guard.accumulation_steps)
    guard.settle_pending()  # spikes of fused optimizers' pending windows
    saved = rng_state(guard.device.type)
    try:
        return [_diagnose(guard, watch, source, e.step) for e in watch.events]
    finally:
        set_rng_state(guard.device.type, saved)


# ---------------------------------------------------------------------- signals
def _last_layer(model: torch.nn.Module) -> str | None:
    names = [n for n, m in model.named_modules() if any(True for _ in m.parameters(False))]
    return names[-1] if names else None


# ---------------------------------------------------------------------- replay
REL_TOL = 1e-3  # a replayed loss "equals" the recorded one within this (relative)


def _unusable(guard: Any, watch: Any, source: Any, step: int) -> tuple[str | None, Snapshot | None]:
    refused = getattr(guard, "no_replay", None)  # an attach handle's framework forbids it
    if refused is not None:
        return refused, None
    if guard.distributed is not None:
        return (
            "a distributed model is not replayed: each rank's batch and the gradient "
            "reduction differ from what one process can redo",
            None,
        )
    if watch.snapshots is None:
        return "no snapshots (snapshot=False)", None
    snap = watch.snapshots.for_spike(step)
    if snap is None:
        return f"no snapshot from before step {step - 1}", None
    missing = [s for s in range(snap.step + 1, step + 1) if s not in source]
    if missing:
        return (
            f"no batch recorded for step {missing[0]}: "
            f"{getattr(guard, 'record_hint', GUARD_RECORD_HINT)}, so the autopsy can replay",
            None,
        )
    return None, snap


def _same(got: float, want: Any) -> bool:
    return want is None or math.isclose(got, want, rel_tol=REL_TOL, abs_tol=1e-6)


def _removes(loss: float, bound: float, level: Any, replayed: float) -> bool:
    """The intervention's loss at ``t`` removes the spike: back in the lower half (in log) of
    the band between the running level and the detector's bound, i.e. within about 3 of the
    detector's 6 noise units of the level; a loss just under the bound is still an anomaly,
    and a verdict resting on it would flip on noise. Without a level: under the bound."""
    if not math.isfinite(loss) or loss > bound or loss >= replayed:
        return False
    if not level or level <= 0 or bound <= level:
        return True
    return math.log(max(loss, 1e-30) / level) <= 0.5 * math.log(bound / level)


def _diagnose(guard: Any, watch: Any, source: Any, step: int) -> SpikeDiagnosis:
    rows = {r["step"]: r for r in watch.ring.rows()}
    mech, layer, evidence = signal_read(rows, watch.names, step, _last_layer(guard.model))
    row = rows.get(step, {})
    evidence.update({"loss": row.get("loss"), "bound": row.get("bound"), "level": row.get("level")})

    def unverified(why: str) -> SpikeDiagnosis:
        evidence["replay"] = why
        return SpikeDiagnosis(step, mech, layer, evidence, FIXES[mech], False)

    why, snap = _unusable(guard, watch, source, step)
    if why is not None or snap is None:
        return unverified(str(why))
    rep = Replay(guard, source, snap, rows)
    try:
        g = rep.new_guard()
        for s in range(snap.step + 1, step - 1):  # up to t - 2, checked against the recording
            got, want = rep.window(g, s), rows.get(s, {}).get("loss")
            if not _same(got, want):
                return unverified(_differs(s, got, want) + getattr(guard, "differs_hint", ""))
        start = rep.take(step - 2)
        prev, replayed, ratios = plain(rep, step)
        evidence["replayed_loss"] = replayed
        for s, got in ((step - 1, prev), (step, replayed)):
            if not _same(got, rows.get(s, {}).get("loss")):
                return unverified(
                    _differs(s, got, rows[s]["loss"]) + getattr(guard, "differs_hint", "")
                )
        evidence["reproduced"] = True  # the replay's losses at t - 1 and t are the recorded
        bound = row.get("bound")
        if bound is None or replayed <= bound:
            return unverified(f"the replay did not reproduce the spike: loss {replayed:.6g}")
        rep.restore(start)
        before = rep.window(rep.new_guard(), step, train=False)
        evidence["loss_before_update"] = before
        data = before > bound  # the batch spikes without t - 1's update: the data's
        return _intervene(rep, step, start, ratios, data, evidence, (mech, layer)) or (
            SpikeDiagnosis(step, mech, layer, evidence, FIXES[mech], False)
        )
    finally:
        rep.release()


def _differs(step: int, got: float, want: float) -> str:
    return (
        f"the replay did not reproduce step {step}: loss {got:.6g}, recorded {want:.6g} "
        "(something outside the Guard consumes the RNG or changes the data, or the numbers "
        "are not deterministic); nothing is verified"
    )


def _intervene(
    rep: Replay,
    step: int,
    start: Snapshot,
    ratios: dict[str, float],
    data: bool,
    evidence: dict[str, Any],
    read: tuple[str, str | None],
) -> SpikeDiagnosis | None:
    """Try the plan's interventions in order; the diagnosis of the first that removes the
    spike, or None (``evidence`` gets every result either way)."""
    row = rep.rows[step]
    bound, level, replayed = row["bound"], row.get("level"), evidence["replayed_loss"]
    suspects = _suspects(ratios) or ([read[1]] if read[1] else [])
    outliers = _outliers(ratios)
    evidence["suspect_layers"] = suspects
    if not data:
        evidence["not_tried"] = {
            "drop_outliers": "the batch does not spike at the weights before the update of "
            f"step {step - 1} (loss {evidence['loss_before_update']:.6g}): the update is the "
            "suspect, not the data"
        }
    tried: dict[str, float] = {}
    evidence["interventions"] = tried
    last = _last_layer(rep.guard.model)
    for name, kind, layers in _plan(suspects, outliers, data):
        rep.restore(start)
        try:
            loss = interventions(rep, step, layers, ratios)[kind]()
        except NotApplicable as err:
            tried[name] = math.nan
            evidence.setdefault("not_applicable", {})[name] = str(err)
            continue
        tried[name] = loss
        if _removes(loss, bound, level, replayed):
            evidence["removed_by"] = name
            mech, layer = _mechanism(rep, kind, layers, last)
            return SpikeDiagnosis(step, mech, layer, evidence, FIXES[mech], True)
    return None


def _suspects(ratios: dict[str, float], top: int = 2) -> list[str]:
    """The ``top`` layers with the largest update-to-weight ratio at ``t - 1``."""
    best = _by_layer(ratios)
    return list(sorted(best, key=lambda k: -best[k])[:top])


def _outliers(ratios: dict[str, float], factor: float = 10.0) -> list[str]:
    """The layers whose update ratio is at least ``factor`` x the median layer's, largest
    first."""
    best = _by_layer(ratios)
    if not best:
        return []
    median = sorted(best.values())[len(best) // 2]
    return sorted((k for k, v in best.items() if v >= factor * median > 0), key=lambda k: -best[k])


def _by_layer(ratios: dict[str, float]) -> dict[str, float]:
    best: dict[str, float] = {}
    for n, r in ratios.items():
        best[layer_of(n)] = max(best.get(layer_of(n), 0.0), r)
    return best


def _plan(suspects: list[str], outliers: list[str], data: bool) -> list[tuple[str, str, list[str]]]:
    """``(name, intervention, layers)`` in the order they are tried: the data (when it is the
    suspect), the optimizer states' precision, each layer intervention on each suspect (and
    ``clip_update`` on all outlier layers together), then the global LR."""
    out: list[tuple[str, str, list[str]]] = [("drop_outliers", "drop_outliers", [])] if data else []
    out.append(("fp32_states", "fp32_states", suspects[:1]))
    group = outliers if len(outliers) > 1 and outliers != suspects[:1] else []
    for kind in ("floor_v", "clip_update", "fp32_layer"):
        for s in suspects:
            out.append((f"{kind}:{s}", kind, [s]))
        if group and kind != "fp32_layer":
            out.append((f"{kind}:{'+'.join(group)}", kind, group))
    out.append(("halve_lr", "halve_lr", suspects[:1]))
    return out


def _mechanism(
    rep: Replay, kind: str, layers: list[str], last: str | None
) -> tuple[str, str | None]:
    layer = layers[0] if layers else None
    if kind == "drop_outliers":
        return "outlier_batch", None
    if kind == "fp32_states":
        return "optimizer_state_rounding", _rounding_layer(rep, layers)
    if kind == "floor_v":
        return "adam_second_moment", layer
    if kind == "clip_update":
        return layer_kind(layer, last), layer
    if kind == "fp32_layer":
        return "lowp_amax_jump", layer
    return "update_outlier", layer


def _rounding_layer(rep: Replay, layers: list[str]) -> str | None:
    """The main suspect when its optimizer states are bf16/fp16, else None."""
    if not layers:
        return None
    ids = {id(p) for n, p in rep.model.named_parameters() if layer_of(n) == layers[0]}
    return layers[0] if low_precision_states(rep.optimizers, ids) else None


SpikeDiagnosis.__module__ = "ampguard.guard"  # its public home: repr and pickles name that path
