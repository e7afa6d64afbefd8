"""``locate``'s optimizer phase: what one optimizer step does to bf16/fp16 weights.

With ``locate(..., optimizer=opt)`` and weights stored in bf16/fp16 (``model.half()``,
``model.to(torch.bfloat16)``), the batch's gradients (at loss scale 1: the step sees unscaled
gradients) go through one real ``opt.step()``; the weights, gradients and the optimizer's state
are put back afterwards. Two findings come from that step, both with ``phase="optimizer"``:

- ``"eps_underflow"`` (AG366): a param group's ``eps`` rounds to 0 in the weights' dtype
  (Adam's default 1e-8 is below fp16's smallest subnormal, 6e-8). Adam's state lives in the
  weights' dtype, so ``m / (sqrt(v) + eps)`` divides by zero wherever ``v`` flushed to zero and
  writes inf/NaN into the weights. Reported from the dtype alone (the step need not break on this
  batch), with the weights the step made non-finite as evidence.
- ``"precision_stagnation"`` (AG365): at least :data:`~ampguard.core.stagnation.STAGNATION_SHARE`
  of a layer's intended updates (elements with a nonzero gradient) left the stored weight
  unchanged: smaller than half an ulp (see :mod:`ampguard.core.stagnation`).

Also here: the text of these kinds (title, explanation, fix) for :mod:`ampguard.forensics._text`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ampguard import precisions
from ampguard.core.stagnation import (
    LOW_PRECISION,
    STAGNATION_SHARE,
    lost_updates,
    owner_names,
    stagnation_fix,
)

__all__ = ["KINDS", "eps_underflows", "optimizer_step", "ema_step", "title", "fix", "explain"]

KINDS = ("precision_stagnation", "eps_underflow")


def check_optimizer(optimizer: Any) -> None:
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer (the one that trains the model) or None, "
            f"got {type(optimizer).__name__}"
        )


def _short(dtype: torch.dtype) -> str:
    return precisions.label(str(dtype).removeprefix("torch."))


def eps_underflows(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Param groups whose ``eps`` rounds to 0 in the dtype of their bf16/fp16 parameters.
    Cost: host arithmetic only."""
    out = []
    for i, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if not isinstance(eps, (int, float)) or eps <= 0:
            continue
        for dtype in sorted(
            {p.dtype for p in group["params"] if p.dtype in LOW_PRECISION}, key=str
        ):
            if float(torch.tensor(float(eps), dtype=dtype)) == 0.0:
                out.append({"group": i, "eps": float(eps), "dtype": _short(dtype)})
    return out


def low_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.dtype in LOW_PRECISION]


def optimizer_step(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    policy: Any,
    optimizer: torch.optim.Optimizer,
) -> tuple[str, str | None, dict[str, Any]] | None:
    """Run one real step of ``optimizer`` on ``batch``'s gradients and judge it.

    Returns ``(kind, module, stats)`` for an ``eps_underflow`` or a ``precision_stagnation``,
    else None. The caller restores the model (``Preserved``); this function restores the
    optimizer's state. Cost: one forward+backward, one optimizer step, a copy of the low-precision
    weights and the optimizer state, a few host syncs.
    """
    low = low_params(optimizer)
    if not low:
        return None
    eps = eps_underflows(optimizer)
    layers = owner_names(model, low)
    saved = copy.deepcopy(optimizer.state_dict())
    try:
        for p in low:
            p.grad = None
        with policy.autocast():
            loss = loss_fn(model, batch)
        loss.float().backward()
        before = [p.detach().clone() for p in low]
        grads = [p.grad for p in low]
        optimizer.step()
        counts = lost_updates(low, before, grads).tolist()
        broke = [
            layers[i]
            for i, (p, b) in enumerate(zip(low, before, strict=True))
            if bool(torch.isfinite(b).all()) and not bool(torch.isfinite(p).all())
        ]
    finally:
        optimizer.load_state_dict(saved)
    if eps:
        first = broke[0] if broke else layers[0]
        return "eps_underflow", first, {"eps_underflow": eps, "nonfinite_after_step": broke}
    shares: dict[str, list[int]] = {}
    for layer, (lost, moving) in zip(layers, counts, strict=True):
        row = shares.setdefault(layer, [0, 0])
        row[0] += lost
        row[1] += moving
    stagnant = {
        layer: round(lost / moving, 4)
        for layer, (lost, moving) in shares.items()
        if moving and lost / moving >= STAGNATION_SHARE
    }
    if not stagnant:
        return None
    worst = max(stagnant, key=lambda k: stagnant[k])
    dtypes = sorted({_short(p.dtype) for p in low})
    return (
        "precision_stagnation",
        worst,
        {"layers": stagnant, "dtype": dtypes, "threshold": STAGNATION_SHARE, "lr": _lrs(optimizer)},
    )


def check_ema(ema: Any, model: torch.nn.Module, decay: Any) -> list[Any]:
    """``ema=`` as :func:`~ampguard.core.ema.as_watches` takes it; ``ema_decay`` in [0, 1]."""
    from ampguard.core.ema import as_watches

    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
        raise ValueError(f"ema_decay must be a number in [0, 1], got {decay!r}")
    return as_watches(ema, model, "ema")


def ema_step(
    watches: list[Any], decay: float, found: tuple[str, str | None, dict[str, Any]] | None
) -> tuple[str, str | None, dict[str, Any]] | None:
    """Judge one ``lerp_`` update at ``decay`` of each EMA/teacher the optimizer does not own
    (:meth:`~ampguard.core.ema.EmaWatch.probe`, on copies) and add its stagnant layers to
    ``found`` (the optimizer's own answer, or None). Cost: a copy and a few elementwise ops
    per EMA tensor; one host sync per watch."""
    rows = [r for w in watches for r in w.probe(decay)]
    stagnant = {
        r.layer: round(r.share, 4) for r in rows if r.moving and r.share >= STAGNATION_SHARE
    }
    if not stagnant:
        return found
    dtypes = sorted({_short(getattr(torch, r.dtype)) for r in rows if r.layer in stagnant})
    if found is not None and found[0] == "precision_stagnation":
        kind, module, stats = found
        stats["layers"].update(stagnant)
        stats["dtype"] = sorted(set(stats["dtype"]) | set(dtypes))
        stats.update(ema_layers=stagnant, ema_decay=float(decay))
        return kind, module, stats
    if found is not None:
        return found
    worst = max(stagnant, key=lambda k: stagnant[k])
    stats = {
        "layers": stagnant,
        "dtype": dtypes,
        "threshold": STAGNATION_SHARE,
        "ema_layers": stagnant,
        "ema_decay": float(decay),
        "owner": "ema",
    }
    return "precision_stagnation", worst, stats


def _lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups if isinstance(g.get("lr"), (int, float))]


# ---------------------------------------------------------------------- text
def _where(module: str | None) -> str:
    return "the root module ('')" if module == "" else repr(module)


def title(d: Any) -> str:
    """The catalogue title and the module (kinds in :data:`KINDS`)."""
    from ampguard.findings.codes import lookup

    return f"{lookup(d.code).title} at {_where(d.module)}"


def fix(d: Any) -> str:
    if d.kind == "eps_underflow":
        eps = d.stats.get("eps_underflow") or [{}]
        dtype = eps[0].get("dtype", "fp16")
        return (
            f"Keep fp32 master weights: leave the model in float32 (no .half() / .to({dtype})) "
            f"and let autocast run the {dtype} math (Guard(precision='fp16') or 'bf16'); or "
            f"give the optimizer an eps that {dtype} holds (eps=1e-4 or more). Restore the last "
            "good checkpoint if the weights are already non-finite."
        )
    own = d.stats.get("owner") == "ema"
    text = "" if own else stagnation_fix(list(d.stats.get("dtype") or ["bf16"])) + " "
    if d.stats.get("ema_layers"):
        text += (
            "For the EMA/teacher the optimizer does not own: update it with "
            "ampguard.watch_ema(ema, model, rescue='kahan').update(decay) (the lost part "
            "carried), or keep the EMA in fp32."
        )
    return text.strip()


def explain(d: Any) -> str:
    s = d.stats
    if d.kind == "eps_underflow":
        eps = s.get("eps_underflow") or [{}]
        e = eps[0]
        broke = s.get("nonfinite_after_step") or s.get("nonfinite_tensors") or []
        seen = (
            f" One step on this batch made {', '.join(map(repr, broke[:5]))} non-finite."
            if broke
            else ""
        )
        text = (
            f"In the optimizer step: eps={e.get('eps')} rounds to 0 in {e.get('dtype')}, the "
            "dtype of the weights and of the optimizer's state, so m / (sqrt(v) + eps) divides "
            "by zero wherever v flushed to zero and writes inf/NaN into the weights. The "
            f"forward and backward are not at fault.{seen}"
        )
    else:
        own = {k: v for k, v in s.get("layers", {}).items() if k not in s.get("ema_layers", {})}
        layers = ", ".join(f"{k!r} ({v:.0%})" for k, v in list(own.items())[:6])
        text = (
            "In the optimizer step:"
            if not own
            else (
                f"In the optimizer step: the {'/'.join(s.get('dtype') or [])} weights kept their "
                f"stored value for most elements the optimizer meant to move: {layers} of the "
                "intended updates (elements with a nonzero gradient) rounded away, being smaller "
                "than half a unit in the last place of the weight. Nothing is non-finite; the loss "
                "stalls."
            )
        )
        if s.get("ema_layers"):
            ema = ", ".join(f"{k!r} ({v:.0%})" for k, v in list(s["ema_layers"].items())[:6])
            text += (
                f" The EMA/teacher weights the optimizer does not own: one lerp_ update at decay "
                f"{s.get('ema_decay')} (1 - decay times the gap to the model) rounds away for "
                f"{ema} of the elements it meant to move; the EMA stops following the model."
            )
    return f"{text} Fix: {fix(d)}"
