"""The gradient-fidelity meter: how far a recipe's weight gradients are from bf16's.

For a model and a per-layer recipe (``{layer: format}``), :func:`gradient_fidelity` runs each shadow
micro-batch twice from the same weights: once in plain bf16 autocast, once with the recipe's layers
emulated in their formats (:mod:`ampguard.fp8._emulate`), and compares every Linear's weight
gradient: ``cosine`` (1 is the same direction), ``rel_error`` (``|g - g_bf16| / |g_bf16|``) and
``column_rel_error`` (the median over input features of that error per weight column: an outlier
feature that holds most of the norm hides what the format does to the other columns from the first
two), summed over the micro-batches; and ``lost_inputs``, the share of the layer's input features
(on the first micro-batch) whose values the format's forward cast all but loses (relative error
at least ``LOST``, of the features whose norm is at least ``LIVE`` of the median's: e.g. the
features that share a block with an outlier feature), counted when the input has a massive
feature (norm at least ``MASSIVE`` times the median's; sparse GELU inputs flush benignly):
damage to the forward that the weight gradient, quantised along the batch, does not show. A
layer's figures include what the layers after it (in the backward) cost its gradient: they are
what its optimizer step sees.

:func:`failing` names the layers outside the limits (``MIN_COSINE``, ``MAX_REL_ERROR``,
``MAX_LOST_INPUTS``): the
layers ``ampguard.recipe_search`` promotes before it trains a branch. The weights, gradients and
classes of the model are as before afterwards. Cost: two forward+backward passes per micro-batch
and one host sync (one pass per micro-batch given a :func:`reference_gradients`).
:func:`lost_progress` reads the meter as a predicted effect on the loss: the share of a
training step's loss decrease that the gradient error costs, summed over every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampguard.fp8._emulate import EmulatedLinear, _q, emulate, restore
from ampguard.fp8._formats import FORMATS
from ampguard.fp8._recipe import HIGH

__all__ = [
    "gradient_fidelity",
    "failing",
    "losing_inputs",
    "MIN_COSINE",
    "MAX_REL_ERROR",
    "MAX_LOST_INPUTS",
    "converted",
    "lost_progress",
    "reference_gradients",
]

MIN_COSINE = 0.9  # NVFP4 on a healthy layer: about 0.97; an outlier layer: below 0.5
MAX_REL_ERROR = 0.5  # NVFP4 on a healthy layer: about 0.25
LOST = 0.9  # an input feature whose values the cast changes this much is lost
LIVE = 0.1  # ... when its norm is at least this share of the median feature's
MASSIVE = 200.0  # ... and an input feature this many times the median's norm scales its block
FIRST = "\0first:"  # the key prefix of the first micro-batch's gradient (internal)
MAX_LOST_INPUTS = 0.05  # NVFP4 on a healthy layer: 0; one 100x feature in 128: 15/128


def converted(model: nn.Module, recipe: dict[str, str]) -> list[str]:
    """Emulate each layer of ``recipe`` in its format (``"bf16"``: left as it is); the names of
    the converted layers (undo with ``restore`` on each); all or nothing."""
    done: list[str] = []
    try:
        for fmt in dict.fromkeys(f for f in recipe.values() if f != HIGH):
            done += emulate(model, fmt, _named({n for n, f in recipe.items() if f == fmt}))
    except BaseException:  # all or nothing
        for name in done:
            restore(model.get_submodule(name))
        raise
    return done


def _named(names: set[str]) -> Callable[[nn.Module, str], bool]:
    def keep(module: nn.Module, name: str) -> bool:
        return name in names

    return keep


def _weight_grads(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: Sequence[Any]
) -> dict[str, torch.Tensor]:
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for m in linears.values():
        m.weight.grad = None
    device = next(model.parameters()).device.type
    out: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(batches):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        loss.float().backward()
        for n, m in linears.items():  # the first micro-batch's gradient kept apart
            if i == 0 and m.weight.grad is not None:
                out[FIRST + n] = m.weight.grad.detach().float().clone()
    out.update({n: m.weight.grad.detach().float().clone() for n, m in linears.items()
                if m.weight.grad is not None})  # fmt: skip
    for m in linears.values():
        m.weight.grad = None
    return out


def reference_gradients(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: Sequence[Any]
) -> dict[str, Any]:
    """bf16's weight gradients on ``batches`` and the RNG state they were drawn under: pass it
    as ``reference=`` to every :func:`gradient_fidelity` reading of the same weights and
    batches, and each reading costs one forward+backward pass per batch instead of two. The
    model's gradients and the RNG state are as before afterwards. Cost: one forward+backward
    pass per batch, no host sync."""
    saved = {n: p.grad for n, p in model.named_parameters()}
    devices = _cuda_devices(model)
    with torch.random.fork_rng(devices=devices):
        rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])
        try:
            grads = _weight_grads(model, loss_fn, batches)
        finally:
            for n, p in model.named_parameters():
                p.grad = saved[n]
    return {"grads": grads, "rng": rng, "count": len(batches)}


def _cuda_devices(model: nn.Module) -> list[torch.device]:
    return sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)


def gradient_fidelity(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: Sequence[Any],
    recipe: dict[str, str],
    reference: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """``{layer: {"cosine", "rel_error", "format", ...}}`` of every Linear with a weight
    gradient (see the module docstring; ``grad_sq``/``error_sq``/``noise_sq`` feed
    :func:`lost_progress`). Both passes draw the same random numbers (dropout masks), from the
    RNG state at the call (``reference=``: the state it was taken under), which is left as it
    was. ``reference``: a :func:`reference_gradients` of the same weights and batches (not
    checked). Cost: two forward+backward passes per batch (one with ``reference``), one host
    sync."""
    saved = {n: p.grad for n, p in model.named_parameters()}
    devices = _cuda_devices(model)
    with torch.random.fork_rng(devices=devices):
        return _compare(model, loss_fn, batches, recipe, saved, devices, reference)


def _compare(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: Sequence[Any],
    recipe: dict[str, str],
    saved: dict[str, torch.Tensor | None],
    devices: list[torch.device],
    reference: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    if reference is not None:
        ref = reference["grads"]
        cpu, cuda = reference["rng"]
    else:
        cpu = torch.get_rng_state()
        cuda = [torch.cuda.get_rng_state(d) for d in devices]
    try:
        if reference is None:
            ref = _weight_grads(model, loss_fn, batches)
        torch.set_rng_state(cpu)  # the second pass: the same dropout masks as the first
        for d, state in zip(devices, cuda, strict=True):
            torch.cuda.set_rng_state(state, d)
        layers = converted(model, recipe)
        lost: dict[str, torch.Tensor] = {}
        hooks = [model.get_submodule(n).register_forward_pre_hook(_input_probe(n, lost))
                 for n in layers]  # fmt: skip
        try:
            low = _weight_grads(model, loss_fn, batches)
        finally:
            for h in hooks:
                h.remove()
            for name in layers:
                restore(model.get_submodule(name))
    finally:
        for n, p in model.named_parameters():
            p.grad = saved[n]
    names = [n for n in ref if n in low and not n.startswith(FIRST)]
    if not names:
        return {}
    parts = []
    for n in names:
        a, b = ref[n].reshape(-1), low[n].reshape(-1)
        col = _column_error(ref[n], low[n])
        gone = lost.get(n, a.new_zeros(()))
        noise = _sampling_noise(ref, n, len(batches))
        parts.append(torch.stack([torch.dot(a, b), a.norm(), b.norm(), (a - b).norm(), col, gone,
                                  noise]))  # fmt: skip
    values = torch.stack(parts).tolist()  # the one host sync
    out = {}
    for n, (dot, na, nb, diff, col, gone, noise) in zip(names, values, strict=True):
        cos = dot / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
        rel = diff / na if na > 0 else (0.0 if diff == 0 else float("inf"))
        out[n] = {"cosine": cos, "rel_error": rel, "column_rel_error": col,
                  "lost_inputs": gone, "format": recipe.get(n, HIGH),
                  "grad_sq": na * na, "error_sq": diff * diff, "noise_sq": noise}  # fmt: skip
    return out


def lost_progress(meter: dict[str, dict[str, Any]]) -> float:
    """The predicted loss effect of a meter reading: the share of one training step's loss
    decrease that the gradient error costs, ``sum |g - g_bf16|^2 / sum |g_bf16|^2`` over every
    layer. A step of size ``lr`` along ``g`` lowers the loss by ``lr*<g_bf16, g> -
    lr^2*L/2*|g|^2`` (``L`` the curvature); at the step size ``1/L`` that is ``|g_bf16|^2/(2L)``
    for the bf16 gradient and ``|g_bf16|^2/(2L) - |g - g_bf16|^2/(2L)`` for the recipe's, so the
    ratio is the share of the progress lost. Unlike the per-layer limits it adds up what every
    low-precision layer does to every gradient: a layer whose own gradient reads healthy (a
    head in NVFP4, cosine 0.96) but whose backward spreads error into every layer before it
    counts. 0 for an empty reading; NaN propagates."""
    ref = sum(m.get("grad_sq", 0.0) for m in meter.values())
    err = sum(m.get("error_sq", 0.0) for m in meter.values())
    return err / ref if ref > 0 else (0.0 if err == 0 else float("inf"))


def _sampling_noise(ref: dict[str, torch.Tensor], name: str, count: int) -> torch.Tensor:
    """bf16's own sampling noise of the summed gradient, ``|g_1 - g_rest/(k-1)|^2 * k/4``
    style: the squared difference of the first micro-batch's gradient and the mean of the
    others, scaled to the variance of a sum of ``count`` (0 with one micro-batch)."""
    total = ref[name]
    if count < 2 or FIRST + name not in ref:
        return total.new_zeros(())
    first = ref[FIRST + name]
    rest = (total - first) / (count - 1)
    # Var(g1 - mean of k-1) = s2 (1 + 1/(k-1)); the sum of k has variance k s2
    return (first - rest).pow(2).sum() * count / (1 + 1 / (count - 1))


def _input_probe(name: str, lost: dict[str, torch.Tensor]) -> Callable[..., None]:
    """A forward pre-hook: on the layer's first call, the share of its input features whose
    values the format's input cast changes by at least ``LOST`` (relative, per feature), among
    the features that are not near zero everywhere (``LIVE``). No host sync."""

    def probe(module: nn.Module, args: Any) -> None:
        if name in lost or not isinstance(module, EmulatedLinear) or not args:
            return
        with torch.no_grad():
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            q = _q(x, FORMATS[module.lowp_format], "input")
            ref = x.norm(dim=0)
            err = (q - x).norm(dim=0) / ref.clamp(min=1e-30)
            live = ref > LIVE * ref.median()  # a feature near zero everywhere carries nothing
            massive = ref.max() >= MASSIVE * ref.median()  # an outlier feature scales its block
            lost[name] = ((err >= LOST) & live).float().mean() * massive

    return probe


def _column_error(ref: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The median over input features (weight columns) of each column's relative error: a
    column the format ruins counts even when one outlier column holds most of the norm."""
    na = ref.norm(dim=0)
    err = (ref - low).norm(dim=0) / na.clamp(min=1e-30)
    used = na > 0
    return err[used].median() if bool(used.any()) else ref.new_zeros(())


def failing(meter: dict[str, dict[str, Any]]) -> list[str]:
    """The layers in a low-precision format whose gradient is outside the meter's limits (a
    NaN figure fails)."""
    return [
        n
        for n, m in meter.items()
        if m["format"] != HIGH
        and not (
            m["cosine"] >= MIN_COSINE
            and m["rel_error"] <= MAX_REL_ERROR
            and m["column_rel_error"] <= MAX_REL_ERROR
            and m.get("lost_inputs", 0.0) <= MAX_LOST_INPUTS
        )
    ]


def losing_inputs(meter: dict[str, dict[str, Any]]) -> list[str]:
    """The low-precision layers whose own forward cast loses more than ``MAX_LOST_INPUTS`` of
    their input features (the features sharing a block with a massive one): flagged for the
    values of their own input, which no other layer's format changes (a subset of
    :func:`failing`). Cost: none (reads the figures)."""
    return [
        n
        for n, m in meter.items()
        if m["format"] != HIGH and not m.get("lost_inputs", 0.0) <= MAX_LOST_INPUTS
    ]
