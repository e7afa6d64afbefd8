"""The plan itself: :class:`Fp8Thresholds`, :class:`Fp8Plan` and :func:`fp8_plan` (the
package docstring, :mod:`ampguard.fp8`, describes the figures and the verdict).

The work is split by concern: :mod:`ampguard.fp8._trace` (the traced forward and backward),
:mod:`ampguard.fp8._operand` (each traced tensor converted once, rows sampled),
:mod:`ampguard.fp8._quant` (every format's exact cast), :mod:`ampguard.fp8._multi` (the
figures per format and role, and their verdicts), :mod:`ampguard.fp8._assess` (the fp8
recipe's verdict, fix and reason).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ampguard._util.checks import check_finite
from ampguard._util.jsonnum import finite_or_none
from ampguard.findings import Finding
from ampguard.fp8._assess import assess
from ampguard.fp8._cast import RECIPES
from ampguard.fp8._formats import check_formats
from ampguard.fp8._modules import unconvertible
from ampguard.fp8._multi import LayerMeasure, measure_formats
from ampguard.fp8._operand import sample_rows
from ampguard.fp8._trace import check_batch, trace

__all__ = ["Fp8Plan", "Fp8Thresholds", "fp8_plan", "FIXES"]

FIXES = ("fine", "keep_bf16", "rowwise", "rescale")


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
    tolerance unless given one). ``nominal_margin`` (default 1.0): a format's flushed and
    saturated shares vary between layers with the same statistics by up to their Gaussian
    nominal (NVFP4 flushes 3-11.5% of a GELU layer's gradient against a nominal 6.8%), so a share
    counts against its limit only beyond ``nominal * (1 + nominal_margin)``: a verdict does not
    flip between identical layers. 0 gives the bare rule (excess over the nominal).
    """

    min_sqnr_db: float = 20.0
    max_input_flushed: float = 0.01
    max_weight_flushed: float = 0.01
    max_grad_flushed: float = 0.01
    max_saturated: float = 0.01
    max_sqnr_loss_db: float = 3.0
    nominal_margin: float = 1.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            check_finite(f"Fp8Thresholds.{name}", value)
            if name.endswith("_db"):
                if name == "max_sqnr_loss_db" and value < 0:
                    raise ValueError(f"Fp8Thresholds.{name} must be >= 0 dB, got {value!r}")
            elif name == "nominal_margin" and value < 0:
                raise ValueError(f"Fp8Thresholds.{name} must be >= 0, got {value!r}")
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
    tensor role, cast as torchao's own quantisers cast the block-scaled ones (bitwise; see
    :mod:`ampguard.fp8._quant`):
    ``layers[name]["formats"][format]`` holds the figures, ``ready`` and ``reason``, and
    :meth:`Fp8Plan.recipe` picks a format per layer.

    Cost: one host sync per floating tensor of ``batch`` (the finiteness check), one forward
    in bf16 autocast and a backward to the Linear outputs only (no weight gradient), one copy
    of at least 128 evenly spaced rows and 2**15 values (or all) of each Linear's input,
    weight and output gradient (:mod:`ampguard.fp8._operand`), one matmul and two host syncs
    per layer for the recipe's verdict (and one for all the weights' finiteness: a layer whose
    weight holds NaN or inf is not ready, its reason says it is not finite); per extra format,
    three casts, one matmul and one host sync per layer (a format equal to the recipe reuses its
    figures). A plan costs about the same whatever the batch size.
    """
    _check(model, loss_fn, recipe, thresholds)
    check_batch(batch)
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
    captured = trace(model, loss_fn, batch, linears)
    order = [n for n in captured if n in linears]
    rec = RECIPES[recipe]
    alt = RECIPES["rowwise"] if recipe == "tensorwise" else None
    layers = {}
    broken = _nonfinite_weights(linears)
    for n, m in linears.items():
        measured = _measured(m, captured.pop(n, None))
        layers[n] = assess(m, measured, rec, alt, th)
        if names:
            shape = (m.in_features, m.out_features)
            layers[n]["formats"] = measure_formats(shape, measured, names, th)
        if n in broken:
            _not_finite(layers[n])
    return Fp8Plan(
        recipe,
        th,
        layers,
        time.perf_counter() - started,
        formats=names,
        order=order,
        unconvertible=others,
    )


_NOT_FINITE = (
    "the weight is not finite (it holds NaN or inf): no format can be judged on it; fix the "
    "weights (a diverged step, a bad checkpoint) and plan again"
)


def _nonfinite_weights(linears: dict[str, nn.Linear]) -> set[str]:
    """Names of the Linear layers whose weight holds NaN or inf. Cost: one host sync."""
    if not linears:
        return set()
    with torch.no_grad():
        flags = torch.stack(
            [torch.isfinite(m.weight).all().to(torch.device("cpu")) for m in linears.values()]
        ).tolist()
    return {n for n, ok in zip(linears, flags, strict=True) if not ok}


def _not_finite(info: dict[str, Any]) -> None:
    """A layer whose weight is not finite: not ready in any format, and said why."""
    info.update(ready=False, fix="keep_bf16", problem="weight", reason=_NOT_FINITE)
    for fig in info.get("formats", {}).values():
        fig.update(ready=False, reason=_NOT_FINITE)


def _measured(mod: nn.Linear, cap: dict[str, torch.Tensor] | None) -> LayerMeasure | None:
    """The layer's traced tensors, rows sampled (the same rows for every format)."""
    if cap is None:
        return None
    w = sample_rows(mod.weight, mod.in_features)
    g = sample_rows(cap["g"], mod.out_features) if "g" in cap else None
    return LayerMeasure(sample_rows(cap["x"], mod.in_features), w, g)


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


Fp8Plan.__module__ = "ampguard.fp8"  # its public home: repr and pickles name that path
Fp8Thresholds.__module__ = "ampguard.fp8"  # its public home: repr and pickles name that path
