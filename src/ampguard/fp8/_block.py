"""The Guard's block-scaled precisions (``"mxfp8"``, ``"nvfp4"``, ``"fp8_blockwise"``): Linear
layers trained in the format by emulation, bf16 autocast around them.

:class:`BlockScaled` is the conversion hook (an :class:`ampguard.fp8._conversion.Conversion`)
of the registry entries ``mxfp8`` (:class:`Mxfp8`), ``nvfp4`` (:class:`Nvfp4`) and
``fp8_blockwise`` (:class:`Fp8Blockwise`): the entry's
``hook`` string alone picks the format, since each subclass only names it. Every matmul of a
converted layer (forward, input and weight gradient) quantises its operands as the format
stores them and multiplies in float32 (:mod:`ampguard.fp8._emulate`): the numerics of training
in MXFP8 / NVFP4 on any device (a CPU too), not their speed. No torchao is needed.

Which layers: every ``nn.Linear`` whose shape fits the format (``FORMATS[fmt].shape_ok``: in and out
features multiples of 32 for MXFP8, of 16 for NVFP4, of 128 for block-wise fp8). With ``fp8_plan=``
(an ``ag.fp8_plan(..., formats=(..., fmt))``, which must have measured the format) a layer converts
when the plan's default recipe (``plan.recipe()``) puts it in a low-precision format, not bf16, and
the plan found it ready in *this* format. The recipe picks the lowest precision within tolerance, so
those are the layers whose recipe is this format or a lower precision (fewer bits: a layer ready in
NVFP4 under ``precision="mxfp8"``) whose verdict in this format is also "ready"; a layer the recipe
keeps in bf16 (the first and last Linear, small layers, a layer no format suits) stays in bf16. With
no layer chosen the Guard trains in bf16 and warns (``ampguard.guard._fp8``).

Converting changes the class of the chosen modules only (``EmulatedLinear``): parameters,
optimizer state and the model's state dict stay as they are, and :meth:`BlockScaled.revert`
undoes it exactly. The Guard state (``"fp8"``) records the format and the converted layers; a
resumed Guard converts exactly those (a warning when it had chosen others). No telemetry of its
own and no rescue: :meth:`~BlockScaled.watch` does nothing (``auto_fallback`` still covers the
Guard's own fallbacks), :meth:`~BlockScaled.findings` is empty. Cost: none at construction
(no device op); see :mod:`ampguard.fp8._emulate` for a converted matmul's.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ampguard._util.stack import user_stacklevel
from ampguard.fp8._convert import check_plan_shapes
from ampguard.fp8._emulate import EmulatedLinear, emulate, restore
from ampguard.fp8._formats import FORMATS
from ampguard.fp8._modules import unconvertible
from ampguard.fp8._recipe import HIGH

if TYPE_CHECKING:
    from ampguard.findings import Finding
    from ampguard.fp8._conversion import Conversion, Rescues
    from ampguard.fp8._stats import Fp8Log, WindowClock

__all__ = ["BlockScaled", "Mxfp8", "Nvfp4", "Fp8Blockwise"]

_warned: set[str] = set()  # formats whose emulation was announced in this process


class BlockScaled:
    """A Guard's Linear layers in a block-scaled format (:attr:`format`), emulated.

    Two phases, as every conversion: the constructor checks the plan and chooses the layers
    without touching the model; :meth:`convert` converts them, :meth:`revert` undoes it.
    """

    format: ClassVar[str]  # a name of ampguard.fp8._formats.FORMATS, set by each subclass
    emulated = True  # always: the matmul runs in float32 on the quantised operands
    rescue: Rescues | None = None  # no layer moves back to bf16 while training

    def __init__(self, model: nn.Module, device: torch.device, plan: Any = None) -> None:
        self.model = model
        self.device = device
        self.plan = _checked_plan(plan, self.format, model)
        spec = FORMATS[self.format]
        self._linears = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and spec.shape_ok(m.in_features, m.out_features)
        ]
        self._all = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        planned = _planned(self.plan, self.format) if self.plan is not None else None
        self._chosen = [
            n
            for n in self._linears
            if type(model.get_submodule(n)) is nn.Linear and (planned is None or n in planned)
        ]
        self.layers: list[str] = []
        self.kept: list[str] = list(self._all)
        self.unconvertible: list[str] = []

    @property
    def chosen(self) -> bool:
        """True when at least one Linear layer will train in the format."""
        return bool(self._chosen)

    def convert(self) -> None:
        """Emulate the format in the chosen layers (their class changes, nothing else); on any
        failure the converted ones are plain ``nn.Linear`` again before the error propagates."""
        if self._chosen and self.format not in _warned:
            _warned.add(self.format)
            warnings.warn(
                f"precision={self.format!r} is emulated on every device: real "
                f"{self.format.upper()} casts of every matmul operand, the matmul in float32 "
                "(numerics of the format, not its speed)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        chosen = set(self._chosen)
        try:
            self.layers = emulate(self.model, self.format, lambda m, name: name in chosen)
        except BaseException:
            self._restore(chosen)
            raise
        self.kept = [n for n in self._all if n not in self.layers]
        self.unconvertible = list(unconvertible(self.model))

    def revert(self) -> None:
        """Make the converted layers plain ``nn.Linear`` again. Cost: no device op."""
        self._restore(set(self.layers))
        self.layers = []
        self.kept = list(self._all)

    def _restore(self, names: set[str]) -> None:
        for name in names:
            module = self.model.get_submodule(name)
            if isinstance(module, EmulatedLinear):
                restore(module)

    def watch(self, telemetry: Fp8Log | None, clock: WindowClock, *, rescue: bool = False) -> None:
        """Record which layers run in the format (``meta.json["lowp"]``: the report names
        them); block-scaled layers have no per-layer telemetry or rescue of their own."""
        if telemetry is not None:
            telemetry.annotate("lowp", self.summary())

    def state(self) -> dict[str, Any]:
        """Guard state ``"fp8"``: ``{"format": fmt, "converted": [layer names]}``."""
        return {"format": self.format, "converted": list(self.layers)}

    def check_state(self, value: Any) -> list[dict[str, Any]]:
        """Validate a saved ``"fp8"`` state (``ValueError`` naming the field, nothing changed);
        ``[{"module": name}, ...]`` for the layers to convert ([] for None: nothing saved)."""
        if value is None:
            return []
        saved = value.get("format") if isinstance(value, dict) else None
        layers = value.get("converted") if isinstance(value, dict) else None
        if isinstance(value, dict) and "rescued" in value and saved is None:
            raise ValueError(  # an fp8 (torchao) Guard's state
                f"the Guard state trained its Linear layers in 'fp8' but this Guard uses "
                f"precision={self.format!r}; create the Guard with precision='fp8' to resume it"
            )
        if saved in FORMATS and saved != self.format:
            raise ValueError(
                f"the Guard state trained its Linear layers in {saved!r} but this Guard uses "
                f"precision={self.format!r}; create the Guard with precision={saved!r} to "
                "resume it"
            )
        if saved != self.format or not (
            isinstance(layers, list) and all(isinstance(n, str) for n in layers)
        ):
            raise ValueError(
                f"malformed Guard state: 'fp8' must be {{'format': {self.format!r}, "
                f"'converted': [layer names]}}, got {value!r:.80}"
            )
        unknown = [n for n in layers if n not in self._linears]
        if unknown:
            raise ValueError(
                f"malformed Guard state: 'fp8.converted' names layers that are not Linear "
                f"layers of this model that fit {self.format}: {unknown[:5]}"
            )
        return [{"module": n} for n in layers]

    def load(self, changes: list[dict[str, Any]], telemetry: Fp8Log | None) -> None:
        """Convert exactly the checked layers of a saved state (warns when this Guard had
        chosen others). Cost: no device op."""
        names = [c["module"] for c in changes]
        if set(names) == set(self.layers):
            return
        warnings.warn(
            f"precision={self.format!r}: the Guard state converted {sorted(names)}, this Guard "
            f"had chosen {sorted(self.layers)}; resuming with the saved layers",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        self.revert()
        wanted = set(names)
        self._chosen = [n for n in self._linears if n in wanted]
        self.convert()

    def summary(self) -> dict[str, Any]:
        """JSON-ready: format, emulated, converted and kept layers, the plan's recipe."""
        out: dict[str, Any] = {
            "format": self.format,
            "emulated": self.emulated,
            "converted": list(self.layers),
            "kept_bf16": list(self.kept),
            "unconvertible": list(self.unconvertible),
        }
        if self.plan is not None:
            out["plan"] = self.plan.recipe()
        return out

    def findings(self) -> list[Finding]:
        """None: no telemetry of its own (``ag.compare`` variants judge a format's training)."""
        return []


class Mxfp8(BlockScaled):
    """MXFP8: e4m3 values (e5m2 gradients), an e8m0 scale per 32 along the reduction."""

    format = "mxfp8"


class Nvfp4(BlockScaled):
    """NVFP4: e2m1 values, an e4m3 scale per 16 and an fp32 scale per tensor."""

    format = "nvfp4"


class Fp8Blockwise(BlockScaled):
    """Block-wise fp8 (DeepSeek-V3): e4m3 values, an fp32 scale per 1x128 tile of an input or
    gradient and per 128x128 block of a weight."""

    format = "fp8_blockwise"


def _checked_plan(plan: Any, fmt: str, model: nn.Module) -> Any:
    """``plan`` after checking it is an Fp8Plan of this model that measured ``fmt``."""
    if plan is None:
        return None
    from ampguard.fp8 import Fp8Plan

    if not isinstance(plan, Fp8Plan):
        raise TypeError(
            f"fp8_plan must be an ampguard.Fp8Plan (from ag.fp8_plan) or None, "
            f"got {type(plan).__name__}"
        )
    if fmt not in plan.formats:
        raise ValueError(
            f"fp8_plan did not measure {fmt!r} (its formats: {plan.formats}); for "
            f"precision={fmt!r} make it with ag.fp8_plan(..., formats=(..., {fmt!r}))"
        )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(plan.layers) - set(linears))
    if unknown:
        raise ValueError(
            f"fp8_plan was made for another model: its layers {unknown[:5]} "
            "are not Linear layers of this model"
        )
    check_plan_shapes(plan, linears)
    return plan


def _planned(plan: Any, fmt: str) -> set[str]:
    """The layers the plan's recipe puts in low precision and that are ready in ``fmt``."""
    recipe = plan.recipe()
    return {
        n
        for n, choice in recipe.items()
        if choice != HIGH and plan.layers[n].get("formats", {}).get(fmt, {}).get("ready")
    }


if TYPE_CHECKING:  # mypy proves that the hook is a Conversion

    def _is_conversion(hook: BlockScaled) -> Conversion:
        return hook
