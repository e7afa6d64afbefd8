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
from ampguard.fp8._formats import FORMATS, check_formats
from ampguard.fp8._modules import conv1d_to_linear, unconvertible
from ampguard.fp8._multi import measure_formats

__all__ = ["Fp8Plan", "Fp8Thresholds", "fp8_plan", "FIXES", "FORMATS", "conv1d_to_linear"]

FIXES = ("fine", "keep_bf16", "rowwise", "rescale")
_MULTIPLE = 16  # torch._scaled_mm: both matmul dimensions must be multiples of 16
_MAX_ROWS = 256  # rows of input/gradient measured per layer, evenly spaced (bounds the cost)
_FORMAT_ROWS = 256  # rows of the weight (evenly spaced) measured per extra format


@dataclass(frozen=True)
class Fp8Thresholds:
    """Limits a layer must stay within to be ready for fp8.

    ``min_sqnr_db`` (default 20 dB; a healthy layer measures about 28 dB in e4m3, an outlier
    feature of 3e4x its median drives it below 20), ``max_input_flushed`` and
    ``max_weight_flushed`` (default 1% of the nonzero values becoming zero in e4m3; outlier
    features of 1e4x flush about 4%), ``max_grad_flushed`` (default 1% in the gradient dtype).

    For the formats of ``fp8_plan(..., formats=...)`` (see :mod:`ampguard.fp8._multi`):
    ``max_saturated`` (default 1% of the nonzero values clipped at their scale's largest value)
    and ``max_sqnr_loss_db`` (default 3 dB: how far a layer's output SQNR in a format may fall
    below that format's nominal SQNR on a Gaussian layer; ``plan.recipe()`` takes it as its
    tolerance unless given one).
    """

    min_sqnr_db: float = 20.0
    max_input_flushed: float = 0.01
    max_weight_flushed: float = 0.01
    max_grad_flushed: float = 0.01
    max_saturated: float = 0.01
    max_sqnr_loss_db: float = 3.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            check_finite(f"Fp8Thresholds.{name}", value)
            if name.endswith("_db"):
                if name == "max_sqnr_loss_db" and value < 0:
                    raise ValueError(f"Fp8Thresholds.{name} must be >= 0 dB, got {value!r}")
            elif name.startswith("max_") and not 0 <= value <= 1:
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

    float8_recipe: str
    thresholds: Fp8Thresholds
    layers: dict[str, dict[str, Any]]
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    unconvertible: dict[str, dict[str, Any]] = field(default_factory=dict)
    formats: tuple[str, ...] = ()
    order: list[str] = field(default_factory=list)  # Linear layers in the order they ran

    def recipe(
        self,
        max_sqnr_loss_db: float | None = None,
        *,
        keep_first_last: bool = True,
        min_features: int = 64,
    ) -> dict[str, str]:
        """``{module_name: format}`` for every Linear: the lowest-precision measured format in
        which the layer is ready under ``max_sqnr_loss_db`` (default: the thresholds'), else
        ``"bf16"``. Structural rules: with ``keep_first_last`` the first and the last Linear that
        ran stay in bf16 (the embedding-side projection and the output head carry the most
        error into the loss); a layer with in or out features below ``min_features`` stays in
        bf16 (a small matmul gains nothing from low precision). Among formats of equal bits the
        order of ``formats=`` decides. Without ``formats=`` the plan's fp8 recipe is the one
        format. Cost: none (reads the measured figures).
        """
        from ampguard.fp8._recipe import layer_recipe

        return layer_recipe(self, max_sqnr_loss_db, keep_first_last, min_features)

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
            "recipe": self.float8_recipe,
            "formats": list(self.formats),
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
    formats: tuple[str, ...] | None = None,
) -> Fp8Plan:
    """Trace one bf16 forward + backward of ``loss_fn(model, batch)`` and judge every Linear.

    Parameters, gradients, buffers, RNG state and training modes are as before afterwards, and
    no hook is left behind. Raises ``ValueError``/``TypeError`` naming the bad argument; a
    ``batch`` whose tensors hold no rows, or a non-finite value, is a ``ValueError`` naming
    ``batch`` (there is nothing to measure: no verdict).
    With ``formats=`` (names from :data:`ampguard.fp8._formats.FORMATS`: ``"tensorwise"``,
    ``"rowwise"``, ``"mxfp8"``, ``"nvfp4"``) every layer is also measured in each format, per
    tensor role, with torchao's own quantisers for the block-scaled ones:
    ``layers[name]["formats"][format]`` holds the figures, ``ready`` and ``reason``, and
    :meth:`Fp8Plan.recipe` picks a format per layer.

    Cost: one host sync per floating tensor of ``batch`` (the finiteness check), one forward +
    backward in bf16 autocast, one copy of each Linear's input and output gradient (at most 256
    evenly spaced rows each), two small matmuls per layer and one host sync per layer; per extra
    format, three quantisations (at most 256 evenly spaced rows of each tensor), one small
    matmul and one host sync per layer. A plan costs about the same whatever the batch size.
    """
    _check(model, loss_fn, recipe, thresholds)
    _check_batch(batch)
    names = () if formats is None else check_formats(formats)
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
    if names:
        for n, m in linears.items():
            layers[n]["formats"] = _formats_of(m, captured.get(n), names, th)
    order = [n for n in captured if n in linears]
    return Fp8Plan(
        recipe,
        th,
        layers,
        time.perf_counter() - started,
        formats=names,
        order=order,
        unconvertible=others,
    )


def _formats_of(
    mod: nn.Linear, cap: dict[str, torch.Tensor] | None, names: tuple[str, ...], th: Fp8Thresholds
) -> dict[str, dict[str, Any]]:
    x = g = None
    if cap is not None:
        x = _rows(cap["x"], mod.in_features)
        g = _rows(cap["g"], mod.out_features) if "g" in cap else None
    w = _spaced(mod.weight.detach().to(torch.bfloat16))
    return measure_formats((mod.in_features, mod.out_features), x, w, g, names, th)


def _spaced(t: torch.Tensor) -> torch.Tensor:
    """At most ``_FORMAT_ROWS`` evenly spaced rows of ``t`` (what each extra format measures)."""
    step = -(-t.shape[0] // _FORMAT_ROWS)
    return t[::step].contiguous()


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


def _tensors(batch: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``batch`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif depth < 8 and isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _tensors(item, depth + 1)
    elif depth < 8 and isinstance(batch, dict):
        for item in batch.values():
            yield from _tensors(item, depth + 1)


def _check_batch(batch: Any) -> None:
    """``ValueError`` naming ``batch`` when a tensor of it is empty or not finite."""
    for i, t in enumerate(_tensors(batch)):
        what = "batch" if isinstance(batch, torch.Tensor) else f"batch (tensor {i})"
        if t.numel() == 0 or (t.dim() > 0 and t.shape[0] == 0):
            raise ValueError(
                f"{what} has 0 rows (shape {tuple(t.shape)}): the plan measures each Linear "
                "on one real batch; pass one with at least one sample"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"the batch is not finite: {what} holds NaN or inf values; the plan would "
                "measure the bad values, not the layers. Pass a batch of real data"
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
    flat = t.reshape(-1, width)
    step = -(-flat.shape[0] // _MAX_ROWS)
    return flat[::step].to(torch.bfloat16)  # what the fp8 cast sees


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
        w = _spaced(mod.weight.detach().to(torch.bfloat16))
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
