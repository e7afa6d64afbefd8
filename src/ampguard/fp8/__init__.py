"""fp8 readiness plan: which ``nn.Linear`` layers can train in fp8, and why not, before training.

Modules that do matmuls but are not ``nn.Linear`` (transformers ``Conv1D``, ...) are named in
``plan.unconvertible`` with their fix (:mod:`ampguard.fp8._modules`, ``ag.conv1d_to_linear``).

One traced forward + backward in bf16 autocast captures every Linear layer's input, weight and
output gradient; each is cast as torchao's float8 training would cast it (``recipe``:
``"tensorwise"`` or ``"rowwise"``, see :mod:`ampguard.fp8._cast`) and measured:

- ``eligible``: in and out features are multiples of 16 (what fp8 matmuls, ``torch._scaled_mm``,
  accept);
- ``sqnr_db``: the layer's output (no bias) from e4m3 input and weight against the bf16 output;
- ``input_flushed`` / ``weight_flushed``: share of the nonzero values that become zero in e4m3
  (an outlier feature sets the amax and pushes ordinary values below e4m3's smallest subnormal);
- ``grad_flushed``: the same for the output gradient in the recipe's gradient dtype (e5m2 under
  ``"tensorwise"``, e4m3 under torchao's ``"rowwise"``).

A layer is *ready* when it is eligible and no figure crosses its :class:`Fp8Thresholds` limit.
``plan.module_filter_fn`` hands the verdict to ``torchao.float8.convert_to_float8_training``;
``ag.Guard(..., precision="fp8", fp8_plan=plan)`` uses it directly. This module needs torch only.
(It is not called ``fp8_plan``: importing ``ampguard.fp8_plan`` would then replace the
``ampguard.fp8_plan`` function with the module.)

>>> plan = ag.fp8_plan(model, loss_fn, batch)        # loss_fn(model, batch) -> scalar loss
>>> print(plan.summary())
>>> guard = ag.Guard(model, opt, precision="fp8", fp8_plan=plan)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ampguard._util.checks import check_finite
from ampguard._util.jsonnum import finite_or_none
from ampguard.core.policy import device_of
from ampguard.findings import Finding
from ampguard.fp8._cast import E4M3, RECIPES, Recipe, flushed_share, quantize, sqnr_db
from ampguard.fp8._modules import conv1d_to_linear, unconvertible

__all__ = ["Fp8Plan", "Fp8Thresholds", "fp8_plan", "FIXES", "conv1d_to_linear"]

FIXES = ("fine", "keep_bf16", "rowwise", "rescale")
_MULTIPLE = 16  # torch._scaled_mm: both matmul dimensions must be multiples of 16
_MAX_ROWS = 4096  # rows of input/gradient measured per layer (bounds the cost on big batches)


@dataclass(frozen=True)
class Fp8Thresholds:
    """Limits a layer must stay within to be ready for fp8.

    ``min_sqnr_db`` (default 20 dB; a healthy layer measures about 28 dB in e4m3, an outlier
    feature of 3e4x its median drives it below 20), ``max_input_flushed`` and
    ``max_weight_flushed`` (default 1% of the nonzero values becoming zero in e4m3; outlier
    features of 1e4x flush about 4%), ``max_grad_flushed`` (default 1% in the gradient dtype).
    """

    min_sqnr_db: float = 20.0
    max_input_flushed: float = 0.01
    max_weight_flushed: float = 0.01
    max_grad_flushed: float = 0.01

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            check_finite(f"Fp8Thresholds.{name}", value)
            if name.startswith("max_") and not 0 <= value <= 1:
                raise ValueError(f"Fp8Thresholds.{name} must be a share in [0, 1], got {value!r}")


@dataclass
class Fp8Plan:
    """The per-layer verdicts of :func:`fp8_plan`.

    ``layers[name]``: ``ready``, ``reason`` (one line), ``fix`` (one of :data:`FIXES`),
    ``problem`` (None, or the first limit crossed: "shape", "input", "weight", "grad", "sqnr",
    "unused"),
    ``eligible``, ``shape`` (in, out), ``sqnr_db``, ``input_flushed``, ``weight_flushed``,
    ``grad_flushed`` (None when no gradient reached the layer), ``input_amax``,
    ``input_outlier_ratio`` (amax over the median nonzero magnitude) and ``grad_amax``.
    ``seconds`` is the wall time of the trace and measurements.

    ``unconvertible[name]``: every other module that does a matmul with its own weight but is
    not an ``nn.Linear`` (transformers ``Conv1D``, ``nn.MultiheadAttention``'s input
    projection, ``nn.Bilinear``, convolutions): ``type``, ``shape``, ``reason``, ``fix``. They
    stay in bf16 under ``precision="fp8"``; the summary and AG355 name them with the fix
    (``ag.conv1d_to_linear(model)`` for Conv1D).
    """

    recipe: str
    thresholds: Fp8Thresholds
    layers: dict[str, dict[str, Any]]
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    unconvertible: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ready_layers(self) -> list[str]:
        """Names of the layers the plan converts to fp8."""
        return [n for n, info in self.layers.items() if info["ready"]]

    @property
    def keep_bf16(self) -> list[str]:
        """Names of the Linear layers the plan keeps in bf16."""
        return [n for n, info in self.layers.items() if not info["ready"]]

    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        """For ``convert_to_float8_training(model, module_filter_fn=plan.module_filter_fn)``:
        True for the Linear layers the plan found ready."""
        info = self.layers.get(fqn)
        return bool(info is not None and info["ready"] and isinstance(module, nn.Linear))

    def summary(self) -> str:
        """A plain-text table: one row per Linear layer, then the count of ready layers."""
        from ampguard.fp8._text import plan_table

        return plan_table(self)

    def findings(self) -> list[Finding]:
        """AG340-AG345 findings, each with its fix (fine, keep in bf16, rowwise, rescale)."""
        from ampguard.fp8._text import plan_findings

        return plan_findings(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (non-finite numbers become None)."""
        return {
            "recipe": self.recipe,
            "thresholds": asdict(self.thresholds),
            "seconds": self.seconds,
            "layers": {
                n: {k: finite_or_none(v) for k, v in info.items()}
                for n, info in self.layers.items()
            },
            "unconvertible": {n: dict(info) for n, info in self.unconvertible.items()},
        }


def fp8_plan(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    *,
    recipe: str = "tensorwise",
    thresholds: Fp8Thresholds | None = None,
) -> Fp8Plan:
    """Trace one bf16 forward + backward of ``loss_fn(model, batch)`` and judge every Linear.

    Parameters, gradients, buffers, RNG state and training modes are as before afterwards, and
    no hook is left behind. Raises ``ValueError``/``TypeError`` naming the bad argument.
    Cost: one forward + backward in bf16 autocast, one copy of each Linear's input and output
    gradient (at most 4096 rows each), a few small matmuls per layer and one host sync per
    layer.
    """
    _check(model, loss_fn, recipe, thresholds)
    th = thresholds or Fp8Thresholds()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    others = unconvertible(model)
    if not linears:
        named = ", ".join(f"{n or '(root)'} ({i['type']})" for n, i in list(others.items())[:8])
        hint = f"; it does its matmuls in {named}" if named else ""
        conv1d = any(i["type"] == "Conv1D" for i in others.values())
        raise ValueError(
            "model has no nn.Linear layers: fp8 training converts nn.Linear only"
            + hint
            + (
                " (ag.conv1d_to_linear(model) turns transformers Conv1D into nn.Linear)"
                if conv1d
                else ""
            )
        )
    started = time.perf_counter()
    captured = _trace(model, loss_fn, batch, linears)
    rec = RECIPES[recipe]
    alt = RECIPES["rowwise"] if recipe == "tensorwise" else None
    layers = {n: _assess(m, captured.get(n), rec, alt, th) for n, m in linears.items()}
    return Fp8Plan(recipe, th, layers, time.perf_counter() - started, unconvertible=others)


def _check(model: Any, loss_fn: Any, recipe: Any, thresholds: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}"
        )
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {tuple(RECIPES)}, got {recipe!r}")
    if thresholds is not None and not isinstance(thresholds, Fp8Thresholds):
        raise TypeError(
            f"thresholds must be an ampguard.Fp8Thresholds or None, got {type(thresholds).__name__}"
        )


@contextlib.contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Leave gradients, buffers and the RNG state as they were (the trace is not a step)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    for p in params:
        p.grad = None
    devices = [p.device for p in params if p.device.type == "cuda"][:1]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])


def _trace(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    linears: dict[str, nn.Linear],
) -> dict[str, dict[str, torch.Tensor]]:
    captured: dict[str, dict[str, torch.Tensor]] = {}

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if name in captured or not args or not isinstance(args[0], torch.Tensor):
                return  # a layer called twice is measured on its first call
            cap = captured[name] = {"x": args[0].detach()}
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: cap.__setitem__("g", g.detach()))

        return hook

    device_type = device_of(model.parameters()).type
    with _preserved(model):
        handles = [m.register_forward_hook(hook_for(n)) for n, m in linears.items()]
        try:
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn(model, batch) must return a single-element tensor")
            if loss.requires_grad:
                loss.float().backward()
        finally:
            for h in handles:
                h.remove()
    return captured


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    return t.reshape(-1, width)[:_MAX_ROWS].to(torch.bfloat16)  # what the fp8 cast sees


def _measure(
    x: torch.Tensor, w: torch.Tensor, g: torch.Tensor | None, rec: Recipe
) -> dict[str, float | None]:
    xq, wq = quantize(x, E4M3, rec), quantize(w, E4M3, rec)
    stats = torch.stack(
        [sqnr_db(x.float() @ w.float().T, xq @ wq.T), flushed_share(x, xq), flushed_share(w, wq)]
    )
    out: dict[str, float | None] = dict(
        zip(("sqnr_db", "input_flushed", "weight_flushed"), stats.tolist(), strict=True)
    )
    out["grad_flushed"] = (
        None if g is None else float(flushed_share(g, quantize(g, rec.grad_dtype, rec)))
    )
    return out


def _assess(
    mod: nn.Linear,
    cap: dict[str, torch.Tensor] | None,
    rec: Recipe,
    alt: Recipe | None,
    th: Fp8Thresholds,
) -> dict[str, Any]:
    shape = (mod.in_features, mod.out_features)
    eligible = all(d % _MULTIPLE == 0 and d > 0 for d in shape)
    info: dict[str, Any] = {
        "ready": False,
        "reason": "",
        "fix": "keep_bf16",
        "problem": "unused",
        "eligible": eligible,
        "shape": shape,
        "sqnr_db": None,
        "input_flushed": None,
        "weight_flushed": None,
        "grad_flushed": None,
        "input_amax": None,
        "input_outlier_ratio": None,
        "grad_amax": None,
    }
    if cap is None:
        info["reason"] = "not called in the traced forward: nothing to measure, kept in bf16"
        return info
    with torch.no_grad():
        x = _rows(cap["x"], mod.in_features)
        w = mod.weight.detach().to(torch.bfloat16)
        g = _rows(cap["g"], mod.out_features) if "g" in cap else None
        info.update(_measure(x, w, g, rec))
        mags = x.float().abs()
        nz = mags[mags > 0]
        amax = float(mags.max()) if mags.numel() else 0.0
        info["input_amax"] = amax
        info["input_outlier_ratio"] = amax / float(nz.median()) if nz.numel() else None
        info["grad_amax"] = None if g is None else float(g.float().abs().max())
        problem = _problem(info, th)
        alt_ok = (
            alt is not None
            and problem in ("input", "weight", "sqnr")
            and _problem({**info, **_measure(x, w, g, alt)}, th) is None
        )
    info["reason"], info["fix"] = _verdict(info, problem, alt_ok, rec, th)
    info["ready"], info["problem"] = problem is None, problem
    return info


def _problem(info: dict[str, Any], th: Fp8Thresholds) -> str | None:
    """The first limit the layer crosses, or None when it is ready."""
    if not info["eligible"]:
        return "shape"
    if info["input_flushed"] > th.max_input_flushed:
        return "input"
    if info["weight_flushed"] > th.max_weight_flushed:
        return "weight"
    if info["grad_flushed"] is not None and info["grad_flushed"] > th.max_grad_flushed:
        return "grad"
    if not info["sqnr_db"] >= th.min_sqnr_db:  # NaN (an all-zero output) is not ready
        return "sqnr"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return "e5m2" if dtype == torch.float8_e5m2 else "e4m3"


def _verdict(
    info: dict[str, Any], problem: str | None, alt_ok: bool, rec: Recipe, th: Fp8Thresholds
) -> tuple[str, str]:
    """(one-line reason, fix) for a measured layer."""
    i, o = info["shape"]
    sq = f"SQNR {info['sqnr_db']:.1f} dB"
    if problem is None:
        grad = "-" if info["grad_flushed"] is None else f"{info['grad_flushed']:.2%}"
        return (
            f"{sq}; flushed: input {info['input_flushed']:.2%}, weight "
            f"{info['weight_flushed']:.2%}, gradient {grad}",
            "fine",
        )
    then = "rowwise" if alt_ok else "keep_bf16"
    if problem == "shape":
        return (
            f"shape {i}x{o}: fp8 matmuls need in and out features that are multiples of "
            f"{_MULTIPLE}",
            "keep_bf16",
        )
    if problem == "input":
        ratio = info["input_outlier_ratio"]
        why = f" (input amax {ratio:.3g}x its median: outlier features)" if ratio else ""
        return (
            f"{info['input_flushed']:.2%} of the input flushes to zero in e4m3 "
            f"(limit {th.max_input_flushed:.2%}){why}",
            then,
        )
    if problem == "weight":
        return (
            f"{info['weight_flushed']:.2%} of the weight flushes to zero in e4m3 "
            f"(limit {th.max_weight_flushed:.2%})",
            then,
        )
    if problem == "grad":
        return (
            f"{info['grad_flushed']:.2%} of the output gradient flushes to zero in "
            f"{_dtype_name(rec.grad_dtype)} (limit {th.max_grad_flushed:.2%}): it spans "
            "more than fp8's window under one scale",
            "rescale",
        )
    return f"{sq} below the {th.min_sqnr_db:g} dB limit", then
