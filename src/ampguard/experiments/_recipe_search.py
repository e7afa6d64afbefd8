"""``ag.recipe_search``: search a per-layer low-precision recipe on the user's model, verified
against bf16's own run-to-run noise.

The search, from one start (``model_factory()`` under ``seeds[0]``) on identical batches:

1. **Risk order.** ``ag.fp8_plan(model, loss_fn, batches[0], formats=formats)`` measures every
   Linear in every format; layers are ordered by their risk in the lowest format (not ready
   first, then by ``sqnr_loss_db``, the SQNR lost to the layer's value distribution).
2. **Groups.** The Linears that read the same tensor (q/k/v, gate/up) move as one
   (:mod:`ampguard.experiments._recipe_groups`).
3. **Start.** Every Linear in the lowest-precision format its shape takes (``"bf16"`` when none).
4. **Prune with the meter.** The gradient-fidelity meter (:mod:`ampguard.fp8._fidelity`: per
   layer cosine and relative error of the recipe's weight gradient against bf16's, and the input
   features its forward loses, on the first shadow micro-batches) flags layers; the earliest
   flagged in the forward moves one format up with its group (and with it every group flagged
   for its own input's values, ``losing_inputs``) and the meter reads again, until nothing is
   flagged (no training step spent). A group is flagged too when its share of the
   meter's predicted loss effect (``lost_progress``: the gradient error's share of a step's
   loss decrease) is at least ``COST_RATIO`` times its share of the matmul FLOPs
   (:func:`_costly`): a head that reads healthy layer by layer but holds most of the error.
5. **bf16's noise.** Two bf16 branches, one from ``seeds[0]``'s start and one built and trained
   under ``seeds[1]`` (another run: its own init, dropout, sampling), give bf16's run-to-run
   spread at the same steps, and the tolerance as ``ag.compare`` judges fp8: three times that
   noise, at least 0.5% of bf16's loss (``tolerance=`` overrides it).
6. **Branches.** The recipe trains a branch (``steps`` steps from ``seeds[0]``'s start, the
   same batches as bf16); it passes when its final loss (the mean of the last tenth) is at most
   bf16's plus ``MARGIN`` (half) of the tolerance: a short branch understates a long run's gap.
   A failing recipe promotes the riskiest group still in the lowest format present one format
   up and trains again; a passing one tries to demote the groups the search promoted, most
   recent first (a demotion the meter flags is pruned without a branch), keeping a demotion
   that still passes. The search stops when the budget is spent.

Budget: ``budget`` is the share of ``len(batches)`` (one full run) that the whole search may
spend in forward+backward passes, each counted as a step: the plan's traced batch, the meter's
(bf16's reference gradients once, then one pass per shadow micro-batch per reading) and every
branch, bf16's two included: ``steps = max(2, left // 4)`` per branch of what the prune left;
one recipe branch always runs, another only while the budget holds it.
Every branch trains with ``optimizer(model.parameters())`` (default AdamW, lr 1e-3) under bf16
autocast, the recipe's layers emulated (:mod:`ampguard.fp8._emulate`). Bad input (an unknown
format, an empty batch list, a factory that returns different models on two calls, a budget out
of range) is one error naming it, before any step (:mod:`ampguard.experiments._recipe_checks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampguard._util.checks import check_finite
from ampguard.experiments._certificate import RecipeCertificate
from ampguard.experiments._fp8 import _tail, bf16_noise
from ampguard.experiments._fp8 import tolerance as bf16_tolerance
from ampguard.experiments._recipe_checks import (
    _check_batches,
    _check_budget,
    _check_factory,
    _check_seeds,
)
from ampguard.experiments._recipe_groups import grouped_order, groups
from ampguard.fp8 import (
    FORMATS,
    HIGH,
    check_formats,
    converted,
    failing,
    gradient_fidelity,
    losing_inputs,
    lost_progress,
    reference_gradients,
    restore,
)

__all__ = ["recipe_search"]

# the microscaling formats (a scale per 32 or 16 values): MXFP8 and NVFP4
DEFAULT_FORMATS = tuple(n for n, f in FORMATS.items() if f.block in (16, 32))
SHADOW_BATCHES = 2  # micro-batches the meter compares gradients on
BRANCHES = 4  # a branch is a quarter of what the meter leaves: bf16's two and two recipe ones
COST_RATIO = 4.0  # a group holding 4x its FLOP share of the gradient error moves up
MIN_LOST = 0.02  # ... when the recipe loses this share of a step's progress (all-MXFP8: ~0.01)
MARGIN = 0.5  # a recipe passes at half the tolerance: a short branch understates a long gap


class _Losses:
    def __init__(self, losses: list[float]) -> None:
        self.losses = losses


def recipe_search(
    model_factory: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: Sequence[Any],
    formats: tuple[str, ...] | str = DEFAULT_FORMATS,
    budget: float = 0.1,
    tolerance: float | None = None,
    *,
    seeds: tuple[int, int] = (0, 1),
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> RecipeCertificate:
    """Search a ``{layer: format}`` recipe and certify it against bf16 (module docstring).

    Returns a :class:`~ampguard.RecipeCertificate`. Raises ``ValueError``/``TypeError`` naming
    the argument for bad input. Cost: about ``budget * len(batches)`` forward+backward passes
    (branch steps, the plan's and the meter's, one per shadow micro-batch per reading; at least
    three branches of 2 steps); one host sync per branch and per meter reading.
    """
    names = check_formats(formats)
    batches = _check_batches(batches)
    total = _check_budget(budget, len(batches))
    check_finite("tolerance", tolerance, optional=True)
    if tolerance is not None and tolerance < 0:
        raise ValueError(f"tolerance must be >= 0 (a loss difference), got {tolerance!r}")
    seeds = _check_seeds(seeds)
    make_opt = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    start = _check_factory(model_factory, seeds[0])

    ladder = [*sorted(names, key=lambda n: FORMATS[n].bits), HIGH]
    order = _risk_order(start, loss_fn, batches[0], names, ladder[0])
    group_of = groups(start, loss_fn, batches[0])
    ranked = grouped_order(order, group_of)
    recipe = {n: _lowest_fit(start, n, ladder) for n in order}
    history: list[dict[str, Any]] = []
    shadow = batches[:SHADOW_BATCHES]
    promoted: list[tuple[str, ...]] = []
    meter = _Meter(start, loss_fn, shadow, group_of)
    _prune(meter, recipe, ladder, history, promoted, "meter")
    # the budget in forward+backward passes: the meter's passes (the plan's traced batch, bf16's
    # reference gradients, one pass per shadow micro-batch per reading) count as steps
    left = total - meter.passes - 1
    steps = max(2, left // BRANCHES)
    left -= 2 * steps
    data = batches[:steps]

    bf16 = _train(model_factory, loss_fn, data, {}, seeds[0], make_opt)
    again = _train(model_factory, loss_fn, data, {}, seeds[1], make_opt)  # its own init too
    noise = bf16_noise(_Losses(bf16), _Losses(again))
    tol = bf16_tolerance(_Losses(bf16), noise) if tolerance is None else float(tolerance)
    base = _tail(bf16)[1]

    def judge(r: dict[str, str], kind: str) -> tuple[bool, float]:
        losses = _train(model_factory, loss_fn, data, r, seeds[0], make_opt)
        delta = _tail(losses)[1] - base
        ok = math.isfinite(delta) and delta <= MARGIN * tol
        history.append({"kind": kind, "recipe": dict(r), "loss_delta": delta, "passed": ok})
        return ok, delta

    passed, delta = judge(recipe, "branch")  # one recipe branch, whatever is left
    left -= steps
    while not passed and left >= steps:
        group = _next_to_promote(recipe, ranked, ladder)
        moved = _promote(start, group[0], recipe, group_of, ladder) if group else ()
        if not moved:
            break
        promoted.append(moved)
        passed, delta = judge(recipe, "promote")
        left -= steps
    for group in reversed(list(dict.fromkeys(promoted))):  # demote what passing allows
        if not passed or left < steps + meter.cost:
            break
        trial = dict(recipe)
        for layer in group:
            lower = _down(start, layer, recipe[layer], ladder)
            if lower is not None:
                trial[layer] = lower
        if trial == recipe:
            continue
        left -= meter.cost
        if set(group) & set(meter.flagged(trial)):
            continue  # the meter prunes it: no branch spent
        ok, d = judge(trial, "demote")
        left -= steps
        if ok:
            recipe, delta = trial, d
    return RecipeCertificate(
        recipe={n: recipe.get(n, HIGH) for n in _linears(start)},
        passed=passed,
        loss_delta=delta,
        noise=noise,
        tolerance=tol,
        flop_share=_flop_share(start, loss_fn, batches[0], recipe),
        steps=steps,
        seeds=tuple(seeds),
        formats=names,
        branches=history,
        meter=meter.read(recipe),
    )


# ---------------------------------------------------------------------- the search's parts
def _linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _fits(model: nn.Module, layer: str, fmt: str) -> bool:
    m = model.get_submodule(layer)
    assert isinstance(m, nn.Linear)
    return fmt == HIGH or FORMATS[fmt].shape_ok(m.in_features, m.out_features)


def _lowest_fit(model: nn.Module, layer: str, ladder: list[str]) -> str:
    return next(f for f in ladder if _fits(model, layer, f))


def _up(model: nn.Module, layer: str, fmt: str, ladder: list[str]) -> str:
    i = ladder.index(fmt)
    return (
        next(f for f in ladder[i + 1 :] if _fits(model, layer, f)) if i + 1 < len(ladder) else fmt
    )


def _down(model: nn.Module, layer: str, fmt: str, ladder: list[str]) -> str | None:
    i = ladder.index(fmt)
    return next((f for f in reversed(ladder[:i]) if _fits(model, layer, f)), None)


def _next_to_promote(
    recipe: dict[str, str], ranked: list[tuple[str, ...]], ladder: list[str]
) -> tuple[str, ...] | None:
    """The riskiest group with a layer in the lowest format the recipe still uses."""
    low = [f for f in ladder if f != HIGH and f in recipe.values()]
    if not low:
        return None
    return next(tuple(n for n in g if recipe[n] == low[0]) for g in ranked
                if any(recipe[n] == low[0] for n in g))  # fmt: skip


def _promote(
    model: nn.Module,
    layer: str,
    recipe: dict[str, str],
    group_of: dict[str, tuple[str, ...]],
    ladder: list[str],
) -> tuple[str, ...]:
    """``layer``'s group, each member in ``layer``'s format, one format up (in place); the
    layers moved."""
    fmt = recipe[layer]
    moved = []
    for n in group_of.get(layer, (layer,)):
        if recipe.get(n) == fmt and fmt != HIGH:
            recipe[n] = _up(model, n, fmt, ladder)
            moved.append(n)
    return tuple(moved)


class _Meter:
    """The fidelity meter on the search's start: bf16's reference gradients once, then one
    forward+backward pass per shadow micro-batch per reading (``passes`` counts them all);
    a reading of a recipe already read is not run again."""

    def __init__(self, model: nn.Module, loss_fn: Callable, shadow: list[Any],
                 group_of: dict[str, tuple[str, ...]]) -> None:  # fmt: skip
        self.model, self.loss_fn, self.shadow, self.group_of = model, loss_fn, shadow, group_of
        self.flops = _layer_flops(model, loss_fn, shadow[0])
        self.ref = reference_gradients(model, loss_fn, shadow)
        self.cost = len(shadow)
        self.passes = len(shadow)
        self.seen: dict[tuple[tuple[str, str], ...], dict[str, dict[str, Any]]] = {}

    def read(self, recipe: dict[str, str]) -> dict[str, dict[str, Any]]:
        key = tuple(sorted(recipe.items()))
        if key not in self.seen:
            self.passes += self.cost
            self.seen[key] = gradient_fidelity(
                self.model, self.loss_fn, self.shadow, recipe, reference=self.ref
            )
        return self.seen[key]

    def flagged(self, recipe: dict[str, str]) -> list[str]:
        """The layers outside the meter's limits, else those of a group too costly for its
        FLOPs (:func:`_costly`)."""
        reading = self.read(recipe)
        return failing(reading) or _costly(reading, self.flops, self.group_of)


def _prune(
    meter: _Meter,
    recipe: dict[str, str],
    ladder: list[str],
    history: list[dict[str, Any]],
    promoted: list[tuple[str, ...]],
    kind: str,
) -> None:
    """Promote what the meter flags, until nothing is: per reading, the earliest flagged group
    in the forward (what a flagged layer feeds may be flagged for its input's sake), and with
    it every group flagged for its own input's values (:func:`ampguard.fp8.losing_inputs`: no
    other layer's format changes those), so two such layers cost one reading, not two."""
    forward = list(meter.group_of)
    for _ in range(len(recipe) * len(ladder)):
        bad = meter.flagged(recipe)
        if not bad:
            return
        first = min(bad, key=forward.index)
        own = [n for n in losing_inputs(meter.read(recipe)) if n in bad]
        before = dict(recipe)
        for layer in dict.fromkeys([first, *sorted(own, key=forward.index)]):
            if recipe[layer] != before[layer]:
                continue  # moved already with its group in this reading
            moved = _promote(meter.model, layer, recipe, meter.group_of, ladder)
            promoted.append(moved)
            history.append({"kind": kind, "promoted": list(moved), "recipe": dict(recipe)})


def _costly(
    meter: dict[str, dict[str, Any]],
    flops: dict[str, float],
    group_of: dict[str, tuple[str, ...]],
) -> list[str]:
    """The low-precision layers of the groups whose share of the predicted loss effect
    (``lost_progress``: their weight gradients' error energy, of all layers') is at least
    ``COST_RATIO`` times their share of the matmul FLOPs, when the recipe loses at least
    ``MIN_LOST`` of a step's progress: promoting such a group buys back the most loss per FLOP
    (a head in NVFP4 that reads healthy layer by layer but holds most of the error)."""
    err = sum(m.get("error_sq", 0.0) for m in meter.values())
    work = sum(flops.values())
    if not (lost_progress(meter) >= MIN_LOST and err > 0 and work > 0):
        return []
    out: list[str] = []
    for group in dict.fromkeys(group_of.values()):
        low = [n for n in group if n in meter and meter[n]["format"] != HIGH]
        share = sum(meter[n].get("error_sq", 0.0) for n in low) / err
        if low and share >= COST_RATIO * sum(flops.get(n, 0.0) for n in low) / work:
            out += low
    return out


def _risk_order(
    model: nn.Module, loss_fn: Callable, batch: Any, formats: tuple[str, ...], lowest: str
) -> list[str]:
    """The traced Linear layers, riskiest first in the lowest format (the plan's figures)."""
    from ampguard.fp8 import fp8_plan

    plan = fp8_plan(model, loss_fn, batch, formats=formats)

    def risk(name: str) -> tuple[int, float]:
        fig = plan.layers[name].get("formats", {}).get(lowest, {})
        loss = fig.get("sqnr_loss_db", math.inf)
        return (0 if fig.get("ready") else 1, -(loss if math.isfinite(loss) else math.inf))

    return sorted(plan.order, key=risk)


def _train(
    factory: Callable[[], nn.Module],
    loss_fn: Callable,
    batches: Sequence[Any],
    recipe: dict[str, str],
    seed: int,
    make_opt: Callable[[Any], torch.optim.Optimizer],
    start: int | None = None,
) -> list[float]:
    """One branch: a fresh model built under ``start`` (default ``seed``), trained under
    ``seed``, the recipe emulated, bf16 autocast around it; the per-step losses (one host sync
    at the end)."""
    torch.manual_seed(seed if start is None else start)
    model = factory()
    torch.manual_seed(seed)
    layers = converted(model, recipe)
    opt = make_opt(model.parameters())
    device = next(model.parameters()).device.type
    losses = []
    try:
        for batch in batches:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
            loss.float().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
    finally:
        for name in layers:
            restore(model.get_submodule(name))
    return [v if math.isfinite(v) else math.nan for v in torch.stack(losses).tolist()]


def _flop_share(
    model: nn.Module, loss_fn: Callable, batch: Any, recipe: dict[str, str]
) -> dict[str, float]:
    """``{format: share of the Linear matmul FLOPs}`` over one forward of ``batch`` (rows x in x
    out per call; the backward's two matmuls scale every layer alike)."""
    flops: dict[str, float] = {}
    for name, v in _layer_flops(model, loss_fn, batch).items():
        fmt = recipe.get(name, HIGH)
        flops[fmt] = flops.get(fmt, 0.0) + v
    total = sum(flops.values())
    return {f: v / total for f, v in flops.items()} if total else {}


def _layer_flops(model: nn.Module, loss_fn: Callable, batch: Any) -> dict[str, float]:
    """``{layer: matmul FLOPs}`` of every Linear over one forward of ``batch`` (rows x in x
    out per call). Cost: one forward, no host sync."""
    flops: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):

            def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
                rows = args[0].numel() // args[0].shape[-1]
                flops[name] = flops.get(name, 0.0) + rows * mod.in_features * mod.out_features

            hooks.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            loss_fn(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return flops
