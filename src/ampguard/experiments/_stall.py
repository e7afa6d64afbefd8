"""``compare``'s ``silent_stall`` verdict: a low-precision variant finite throughout, its loss far
above fp32's at the same applied steps.

A loud failure skips steps or goes non-finite; a *silent* one does neither: an fp16 intermediate
overflows inside a module and is absorbed (``x / sqrt(inf) = 0``), most of a layer's gradient
flushes to zero, or bf16/fp16 weights round every update away. The loss just stays high. A
variant *stalls* when it did not raise, its parameters and every loss stayed finite, it skipped at
most :data:`~ampguard.experiments._verdict.MAX_SKIP_FRACTION` of its steps, and its final loss
(mean of the last tenth) is above fp32's loss *at the same number of applied steps* (skipped
steps do not update the weights, so a variant that skipped is compared with fp32 where fp32 had
applied as many) by more than the tolerance :func:`ampguard.compare` trains by.

The per-layer evidence: ``ag.locate`` runs on the stalled variant's last batch from its final
weights and optimizer state, at the loss scale it ended with (1 without a scaler), with
``optimizer=`` (absorbed overflow, partial underflow, a dead layer, precision stagnation).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from ampguard import precisions

__all__ = ["STALL_ORDER", "stalled", "pick", "explain", "capture", "evidence"]


# which variant's stall the verdict names first (the one a user would run)
STALL_ORDER = ("fp16_dynamic", "fp16_noscaler", "bf16", "fp16_fixed")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def stalled(r: Any, base: Any, tol_rtol: float, max_skip: float) -> dict[str, float] | None:
    """``{"loss", "fp32_loss", "applied"}`` when ``r`` stalled against ``base`` (see the module
    docstring), else None."""
    losses = r.losses
    if r.error is not None or not r.params_finite or not losses or not base.losses:
        return None
    if not all(math.isfinite(x) for x in losses) or r.skipped > max_skip * len(losses):
        return None
    k = max(1, len(losses) // 10)
    applied = max(1, min(len(losses) - r.skipped, len(base.losses)))
    ref = _mean(base.losses[max(0, applied - k) : applied])
    head = _mean(base.losses[:k])
    tail = _mean(losses[-k:])
    tol = tol_rtol * max(abs(head - ref), 0.05 * abs(ref), 1e-12)
    if not (math.isfinite(ref) and tail - ref > tol):
        return None
    return {"loss": tail, "fp32_loss": ref, "applied": float(applied)}


def pick(results: dict[str, Any], tol_rtol: float, max_skip: float) -> tuple[str, dict] | None:
    """The variant whose failure decides the verdict, with its numbers, when it stalled: fp16
    with dynamic scaling when it ran, else the first failed variant in :data:`STALL_ORDER`."""
    base = results[precisions.full()]
    if "fp16_dynamic" in results:
        names: tuple[str, ...] = ("fp16_dynamic",)
    else:
        names = tuple(n for n in STALL_ORDER if n in results and not results[n].trained)[:1]
    for name in names:
        r = results[name]
        found = None if r.trained else stalled(r, base, tol_rtol, max_skip)
        if found is not None:
            return name, found
    return None


def explain(name: str, r: Any, found: dict[str, float]) -> tuple[str, str]:
    """The verdict's explanation and its fix before the per-layer evidence is known."""
    text = (
        f"{r.description} stays finite throughout ({r.skipped} skipped, no non-finite loss) "
        f"but its loss ends at {found['loss']:.4g}, far above fp32's {found['fp32_loss']:.4g} "
        f"at the same {int(found['applied'])} applied steps: a silent stall. Nothing "
        "non-finite reaches the loss or the gradients, so a loss scaler never notices."
    )
    fix = (
        "Find the layer that stalls: ag.locate(model, loss_fn, batch, precision, scale, "
        "optimizer=opt) on a late batch, and the Guard's per-layer findings with "
        "Guard(..., telemetry=RUN_DIR): partial gradient underflow (AG106), a dead layer (AG104), "
        "weights whose updates round away (AG175)."
    )
    return text, fix


def capture(store: dict[str, Any], name: str, exp: Any, batch: Any, scale: float) -> None:
    """Keep what :func:`evidence` replays: the last batch, final weights and optimizer state."""
    store[name] = {
        "batch": copy.deepcopy(batch),
        "state": {k: v.detach().clone() for k, v in exp.model.state_dict().items()},
        "optimizer": copy.deepcopy(exp.optimizer.state_dict()),
        "scale": scale,
    }


def evidence(cmp: Any, name: str, fresh: Any, kept: dict[str, Any], locate: Any) -> None:
    """Run ``locate`` on the stalled variant's last batch and fold its per-layer diagnosis into
    the comparison's explanation and fix (``cmp.diagnosis``)."""
    exp = fresh()
    exp.model.load_state_dict(kept["state"])
    exp.optimizer.load_state_dict(kept["optimizer"])
    # a variant named after a precision trains in it; the fp16_* variants train in fp16
    precision = name if name in precisions.REGISTRY else precisions.scaled()
    try:
        d = locate(
            exp.model,
            exp.loss_fn,
            kept["batch"],
            precision,
            kept["scale"],
            optimizer=exp.optimizer,
        )
    except Exception as exc:  # noqa: BLE001 - the verdict stands without the evidence
        cmp.locate_error = f"locate failed: {type(exc).__name__}: {exc}"
        return
    cmp.diagnosis = d
    cmp.extra["stall"] = {"variant": name, "diagnosis": d.to_dict()}
    if d.ok:
        cmp.explanation += (
            f" locate on the last batch of {name} (scale {kept['scale']:g}) found nothing "
            "on that batch; run the Guard with telemetry for the per-layer series."
        )
        return
    finding = d.to_finding()
    cmp.explanation += (
        f" Per-layer evidence: locate on the last batch of {name} (scale {kept['scale']:g}): "
        f"{finding.code} {finding.message}"
    )
    cmp.fix = finding.fix
