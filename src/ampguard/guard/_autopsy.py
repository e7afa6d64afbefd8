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

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.forensics.islands import Fp32Islands
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
class _Replay:
    """Copies of the loop, a Guard over them, and the recorded batches."""

    def __init__(self, guard: Any, watch: Any, snap: Snapshot, rows: dict[int, Any]) -> None:
        self.guard, self.watch, self.rows = guard, watch, rows
        self.model, self.optimizers, self.schedulers = copy.deepcopy(
            (guard.model, guard.optimizers, watch.schedulers)
        )
        snap.restore(self.model, self.optimizers, self.schedulers)
        self.scale = None if snap.scale is None else snap.scale["scale"].clone()
        self.names = [n for n, _ in self.model.named_parameters()]

    def _guard(self) -> Any:
        from ampguard.guard._guard import Guard  # the class this package defines

        g = Guard(
            self.model,
            self.optimizers,
            precision=self.guard.precision,
            clip_grad_norm=self.guard.clip_grad_norm,
            audit_every=None,
            flight_recorder=False,
            on_spike=None,
            snapshot=False,
        )
        for sched in self.schedulers:
            g.on_applied(_stepper(sched))
        if self.scale is not None and g.loss_scaler is not None:
            g.loss_scaler.scale_tensor.copy_(self.scale)
        return g

    def window(
        self,
        g: Any,
        step: int,
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
        train: bool = True,
    ) -> float:
        batch, loss_fn = self.watch.batches[step]
        with g.autocast():
            loss = loss_fn(self.model, batch)
        value = float(loss.detach().float())
        if not train:
            return value
        g.backward(loss)
        lrs = self.rows.get(step, {}).get("lr")
        groups = [grp for opt in self.optimizers for grp in opt.param_groups]
        if lrs is not None and len(lrs) == len(groups):  # the LRs the run stepped with
            for grp, lr in zip(groups, lrs, strict=True):
                grp["lr"] = lr
        if before is not None:
            before()
        g.step()
        if after is not None:
            after()
        if g.loss_scaler is not None:
            self.scale = g.loss_scaler.scale_tensor.clone()
        return value

    def take(self, step: int) -> Snapshot:
        scale = None if self.scale is None else {"scale": self.scale}
        return Snapshot.take(step, self.model, self.optimizers, self.schedulers, scale)

    def restore(self, snap: Snapshot) -> None:
        snap.restore(self.model, self.optimizers, self.schedulers)
        self.scale = None if snap.scale is None else snap.scale["scale"].clone()


def _stepper(sched: Any) -> Callable[[Any], None]:
    def step(_result: Any) -> None:
        sched.step()

    return step


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
    rep = _Replay(guard, watch, snap, rows)
    g = rep._guard()
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
    plain, ratios = _plain(rep, step)
    evidence["replayed_loss"] = plain
    if bound is None or plain <= bound:
        evidence["replay"] = f"the replay did not reproduce the spike: loss {plain:.6g}"
        return SpikeDiagnosis(step, mech, layer, evidence, FIXES[mech], False)
    suspects = _suspects(ratios) or [layer]
    evidence["suspect_layers"] = suspects
    tried: dict[str, float] = {}
    for name, suspect, fn in _plan(rep, step, suspects, ratios):
        rep.restore(start)
        try:
            loss = fn()
        except _NotApplicable as err:
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


class _NotApplicable(Exception):
    pass


def _suspects(ratios: dict[str, float], top: int = 2) -> list[str | None]:
    """The ``top`` layers with the largest update-to-weight ratio at ``t - 1``."""
    best: dict[str, float] = {}
    for n, r in ratios.items():
        best[layer_of(n)] = max(best.get(layer_of(n), 0.0), r)
    return list(sorted(best, key=lambda k: -best[k])[:top])


_Run = Callable[[], float]


def _plan(
    rep: _Replay, step: int, suspects: list[str | None], ratios: dict[str, float]
) -> list[tuple[str, str | None, _Run]]:
    """``(name, suspect, run)`` in the order they are tried: the data, then each layer
    intervention on each suspect, then the global LR."""
    per = [dict((n, (s, fn)) for n, fn in _interventions(rep, step, s, ratios)) for s in suspects]
    out: list[tuple[str, str | None, _Run]] = [("drop_outliers", None, per[0]["drop_outliers"][1])]
    for kind in ("floor_v", "clip_update", "fp32_layer"):
        for p in per:
            suspect, fn = p[kind]
            out.append((kind if len(per) == 1 else f"{kind}:{suspect}", suspect, fn))
    out.append(("halve_lr", suspects[0], per[0]["halve_lr"][1]))
    return out


def _plain(rep: _Replay, step: int) -> tuple[float, dict[str, float]]:
    """Windows t - 1 and t plainly: the loss at t and the update ratios at t - 1."""
    g = rep._guard()
    params = dict(rep.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    rep.window(g, step - 1)
    ratios = {
        n: float((p.detach() - before[n]).norm() / before[n].norm().clamp_min(1e-30))
        for n, p in params.items()
    }
    return rep.window(g, step, train=False), ratios


def _interventions(
    rep: _Replay, step: int, suspect: str | None, ratios: dict[str, float]
) -> list[tuple[str, _Run]]:
    params = dict(rep.model.named_parameters())
    layer_params = [n for n in params if suspect is not None and layer_of(n) == suspect]

    def drop_outliers() -> float:
        g = rep._guard()
        rep.window(g, step - 1)
        batch, loss_fn = rep.watch.batches[step]
        n = _batch_len(batch)
        if n is None or n < 2:
            raise _NotApplicable("the batch cannot be split by sample")
        with torch.no_grad(), g.autocast():
            per = [float(loss_fn(rep.model, _index(batch, [i]))) for i in range(n)]
        median = sorted(per)[n // 2]
        k = min(max(1, sum(v > 3 * median for v in per)), max(1, n // 4))  # the outliers
        keep = sorted(range(n), key=lambda i: per[i])[: n - k]
        with torch.no_grad(), g.autocast():
            return float(loss_fn(rep.model, _index(batch, keep)))

    def floor_v() -> float:
        g = rep._guard()

        def floor() -> None:
            hit = False
            for opt in rep.optimizers:
                for name in layer_params:
                    st = opt.state.get(params[name], {})
                    v = st.get("exp_avg_sq")
                    if isinstance(v, torch.Tensor) and v.numel():
                        v.clamp_(min=float(v.float().mean()))
                        hit = True
            if not hit:
                raise _NotApplicable("the suspect layer has no Adam second moment")

        rep.window(g, step - 1, before=floor)
        return rep.window(g, step, train=False)

    def clip_update() -> float:
        g = rep._guard()
        others = sorted(v for n, v in ratios.items() if n not in layer_params)
        median = others[len(others) // 2] if others else 0.0  # the other layers' median
        before = {n: params[n].detach().clone() for n in layer_params}

        def clip() -> None:
            with torch.no_grad():
                for n in layer_params:
                    delta = params[n] - before[n]
                    cap = median * float(before[n].norm())
                    norm = float(delta.norm())
                    if norm > cap > 0:
                        params[n].copy_(before[n] + delta * (cap / norm))

        if not layer_params:
            raise _NotApplicable("no suspect layer")
        rep.window(g, step - 1, after=clip)
        return rep.window(g, step, train=False)

    def fp32_layer() -> float:
        if suspect is None or rep.guard.precision == "fp32":
            raise _NotApplicable("the run is fp32 already" if suspect else "no suspect layer")
        g = rep._guard()
        with Fp32Islands(rep.model) as islands:  # the hooks go when the block ends
            if suspect not in dict(rep.model.named_modules()):
                raise _NotApplicable(f"{suspect!r} is a parameter of no submodule")
            islands.add(suspect)
            rep.window(g, step - 1)
            return rep.window(g, step, train=False)

    def halve_lr() -> float:
        g = rep._guard()
        groups = [grp for opt in rep.optimizers for grp in opt.param_groups]
        lrs: list[float] = []

        def half() -> None:  # after the recorded LRs are set
            lrs[:] = [grp["lr"] for grp in groups]
            for grp in groups:
                grp["lr"] *= 0.5

        def back() -> None:
            for grp, lr in zip(groups, lrs, strict=True):
                grp["lr"] = lr

        rep.window(g, step - 1, before=half, after=back)
        return rep.window(g, step, train=False)

    return [
        ("drop_outliers", drop_outliers),
        ("floor_v", floor_v),
        ("clip_update", clip_update),
        ("fp32_layer", fp32_layer),
        ("halve_lr", halve_lr),
    ]


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


def _batch_len(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)) and batch:
        sizes = {_batch_len(b) for b in batch}
        return sizes.pop() if len(sizes) == 1 else None
    if isinstance(batch, dict) and batch:
        sizes = {_batch_len(b) for b in batch.values()}
        return sizes.pop() if len(sizes) == 1 else None
    return None


def _index(batch: Any, idx: list[int]) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[torch.tensor(idx, device=batch.device)]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_index(b, idx) for b in batch)
    if isinstance(batch, dict):
        return {k: _index(v, idx) for k, v in batch.items()}
    return batch
