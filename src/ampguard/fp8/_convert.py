"""fp8's model conversion: torchao float8 training for the Linear layers a plan allows.

:class:`Fp8State` is the fp8 registry entry's conversion hook
(``ampguard.precisions.REGISTRY["fp8"].hook``): the Guard builds it with
``Fp8State(model, device, plan)`` and, when it chose no layer (none eligible, or the plan keeps
them all in bf16), trains in bf16 and says so (``ampguard.guard._fp8``).

The Guard keeps bf16 autocast for everything; this module swaps the chosen ``nn.Linear`` layers
for torchao's ``Float8Linear`` (``convert_to_float8_training`` with the plan's recipe), with
``emulate=True`` where the device has no fp8 matmul (CPU, GPUs before sm_89): real fp8 casts, the
matmul in high precision. The parameters stay the same tensors, so the optimizer, the state dict
and checkpoints are unchanged. With telemetry, :class:`ampguard.fp8._stats.Fp8Monitor` samples the
converted layers every ``range_every`` steps.

torchao is optional (``pip install "ampguard[fp8]"``); it is imported here only, quietly (its
import logs warnings about CUDA extensions a CPU machine cannot load).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampguard._util.stack import user_stacklevel
from ampguard.fp8._modules import CONV1D_FIX, is_hf_conv1d, unconvertible
from ampguard.fp8._torchao import TORCHAO_PIN, Fp8UnavailableError, quiet_logs, require_torchao

if TYPE_CHECKING:
    from ampguard.fp8._rescue import Fp8Rescue
    from ampguard.fp8._stats import Fp8Log, Fp8Monitor, WindowClock

__all__ = [
    "Fp8UnavailableError",
    "require_torchao",
    "Fp8State",
    "eligible",
    "has_fp8_matmul",
    "check_plan_shapes",
    "TORCHAO_PIN",
    "OWN_SAMPLE_EVERY",
    "OWN_SAMPLES_KEPT",
]

_MULTIPLE = 16
_warned_emulation: set[str] = set()


def eligible(module: nn.Module) -> bool:
    """A Linear whose in and out features are multiples of 16 (what fp8 matmuls accept)."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % _MULTIPLE == 0
        and module.out_features % _MULTIPLE == 0
        and module.in_features > 0
        and module.out_features > 0
    )


def has_fp8_matmul(device: torch.device) -> bool:
    """True on CUDA GPUs with fp8 tensor cores (sm_89 and later: Ada, Hopper, Blackwell)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8State:
    """What the Guard keeps about its fp8 layers: the plan, the converted names, emulation.

    Two phases, so a Guard that raises leaves the model as it was: the constructor checks the
    plan, imports torchao and picks the layers without touching the model; :meth:`convert`
    swaps them (all or nothing) and :meth:`revert` puts the original ``nn.Linear`` modules back.
    """

    def __init__(self, model: nn.Module, device: torch.device, plan: Any = None) -> None:
        from ampguard.fp8._plan import Fp8Plan

        if plan is not None and not isinstance(plan, Fp8Plan):
            raise TypeError(
                f"fp8_plan must be an ampguard.Fp8Plan (from ag.fp8_plan) or None, "
                f"got {type(plan).__name__}"
            )
        float8 = require_torchao()
        self._float8 = float8
        self.model: nn.Module = model
        self.plan = plan
        self.recipe = plan.float8_recipe if plan is not None else "tensorwise"
        linears = {n: m for n, m in self.model.named_modules() if isinstance(m, nn.Linear)}
        if plan is not None:
            unknown = sorted(set(plan.layers) - set(linears))
            if unknown:
                raise ValueError(
                    f"fp8_plan was made for another model: its layers {unknown[:5]} "
                    "are not Linear layers of this model"
                )
            check_plan_shapes(plan, linears)
        self._device = device
        self.emulated = not has_fp8_matmul(device)
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        self._config = dataclasses.replace(config, emulate=True) if self.emulated else config
        self._linears = linears
        self._chosen = {n for n, m in linears.items() if self._wanted(m, n, float8)}
        self._originals: dict[str, nn.Module] = {}
        self.layers: list[str] = []
        self.kept: list[str] = list(linears)
        self.monitor: Fp8Monitor | None = None
        self.rescue: Fp8Rescue | None = None  # fp8 -> bf16 moves during training
        self.unconvertible: list[str] = []  # matmuls that are not nn.Linear (set by convert)

    @property
    def chosen(self) -> bool:
        """True when at least one Linear layer will be converted (else nothing runs in fp8)."""
        return bool(self._chosen)

    def convert(self) -> None:
        """Swap the chosen Linear layers for ``Float8Linear`` (same parameter tensors); on any
        failure the swapped ones are put back before the error propagates."""
        float8, model = self._float8, self.model
        if self.emulated:
            _warn_emulated(self._device)
        chosen = self._chosen
        if chosen:
            self._originals = {n: self._linears[n] for n in chosen}
            try:
                with quiet_logs():
                    float8.convert_to_float8_training(
                        model, config=self._config, module_filter_fn=lambda m, fqn: fqn in chosen
                    )
            except BaseException:
                self.revert()
                raise
        self.layers = [
            n for n, m in model.named_modules() if isinstance(m, float8.float8_linear.Float8Linear)
        ]
        self.kept = [n for n in self._linears if n not in self.layers]
        self.unconvertible = list(unconvertible(model))  # matmuls that are not nn.Linear
        if self.unconvertible:
            _warn_unconvertible(model, self.unconvertible)

    def revert(self) -> None:
        """Put back the ``nn.Linear`` modules :meth:`convert` replaced (a Guard that failed
        after the conversion). Cost: no device op."""
        for name, module in self._originals.items():
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, module)
        self._originals = {}
        self.layers = []
        self.kept = list(self._linears)

    def watch(self, telemetry: Fp8Log | None, clock: WindowClock, *, rescue: bool = False) -> None:
        """With telemetry (``range_every`` > 0), sample the converted layers while training
        (``clock``: the loop's window and micro-batch counters); with ``rescue``
        (``auto_fallback=True``) move a drifting layer back to bf16
        (:mod:`ampguard.fp8._rescue`). A rescue without telemetry (or with ``range_every=0``)
        samples on its own schedule, every :data:`OWN_SAMPLE_EVERY` steps, keeping only the last
        :data:`OWN_SAMPLES_KEPT` samples in memory (nothing is written)."""
        if not self.layers:
            return
        own = telemetry is None or not telemetry.range_every
        if own and not rescue:
            return
        from ampguard.fp8._plan import Fp8Thresholds
        from ampguard.fp8._rescue import Fp8Rescue
        from ampguard.fp8._stats import Fp8Monitor

        if own:
            telemetry = _OwnSchedule(OWN_SAMPLE_EVERY)
        assert telemetry is not None
        th = self.plan.thresholds if self.plan is not None else Fp8Thresholds()
        self.monitor = Fp8Monitor(self.model, telemetry, clock, self.layers, self.recipe, th)
        if own:
            self.monitor.max_samples = OWN_SAMPLES_KEPT
        if rescue:
            self.rescue = Fp8Rescue(self, telemetry, th)
            self.monitor.on_records = self.rescue.on_samples

    def release(self, name: str) -> None:
        """Move the converted layer ``name`` back to bf16 (:func:`ampguard.fp8._rescue.to_bf16`)."""
        from ampguard.fp8._rescue import to_bf16

        to_bf16(self.model.get_submodule(name))
        self.layers.remove(name)
        self.kept.append(name)
        if self.monitor is not None:
            self.monitor.drop(name)

    def state(self) -> dict[str, Any] | None:
        """The rescues to resume (Guard state ``"fp8"``), or None when there is nothing."""
        if self.rescue is None or not self.rescue.changes:
            return None
        return {"rescued": [dict(c) for c in self.rescue.changes]}

    def check_state(self, value: Any) -> list[dict[str, Any]]:
        """Validate a saved ``"fp8"`` state against this Guard's layers; the rescues to redo."""
        if value is None:
            return []
        saved = value.get("format") if isinstance(value, dict) else None
        if isinstance(saved, str) and "rescued" not in value:  # fp8 states carry no "format"
            raise ValueError(  # a block-scaled Guard's state (mxfp8, nvfp4)
                f"the Guard state trained its Linear layers in {saved!r} but this Guard uses "
                f"precision='fp8'; create the Guard with precision={saved!r} to resume it"
            )
        rescued = value.get("rescued") if isinstance(value, dict) else None
        if not isinstance(rescued, list) or not all(
            isinstance(c, dict) and isinstance(c.get("module"), str) for c in rescued
        ):
            raise ValueError(
                f"malformed Guard state: 'fp8' must be {{'rescued': [{{'module': name, ...}}]}}, "
                f"got {value!r:.80}"
            )
        known = set(self.layers) | set(self.kept)
        unknown = [c["module"] for c in rescued if c["module"] not in known]
        if unknown:
            raise ValueError(
                f"malformed Guard state: 'fp8.rescued' names layers this fp8 Guard does not "
                f"have: {unknown[:5]}"
            )
        return rescued

    def load(self, rescued: list[dict[str, Any]], telemetry: Fp8Log | None) -> None:
        """Redo checked rescues (a resumed run moves the same layers back to bf16)."""
        if not rescued:
            return
        if self.rescue is None:
            from ampguard.fp8._plan import Fp8Thresholds
            from ampguard.fp8._rescue import Fp8Rescue

            th = self.plan.thresholds if self.plan is not None else Fp8Thresholds()
            self.rescue = Fp8Rescue(self, telemetry, th)
        self.rescue.changes.clear()
        self.rescue.resume(rescued)

    def _wanted(self, module: nn.Linear, name: str, float8: Any) -> bool:
        if isinstance(module, float8.float8_linear.Float8Linear):
            return False  # already converted by the caller
        if self.plan is not None:
            return self.plan.module_filter_fn(module, name) and eligible(module)
        return eligible(module)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: recipe, emulated, converted and kept layers, the plan's verdicts."""
        out: dict[str, Any] = {
            "recipe": self.recipe,
            "emulated": self.emulated,
            "converted": list(self.layers),
            "kept_bf16": list(self.kept),
            "unconvertible": list(self.unconvertible),
        }
        if self.plan is not None:
            out["plan"] = {
                n: {"ready": i["ready"], "fix": i["fix"], "reason": i["reason"]}
                for n, i in self.plan.layers.items()
            }
        if self.monitor is not None:
            out["layers"] = self.monitor.last()
        if self.rescue is not None and self.rescue.changes:
            out["rescued"] = [dict(c) for c in self.rescue.changes]
        return out

    def findings(self) -> list[Any]:
        """AG111/AG112 from the telemetry samples (empty without telemetry), AG113 per rescue."""
        if self.monitor is None:
            return self.rescue.findings() if self.rescue is not None else []
        found = self.monitor.findings()
        if self.rescue is not None:
            found += self.rescue.findings()
        self.monitor.telemetry.annotate("fp8", self.summary())  # the report's fp8 section
        return found


def check_plan_shapes(plan: Any, linears: dict[str, nn.Linear]) -> None:
    """``ValueError`` when a layer of the plan has another (in, out) shape in this model: the
    plan measured another model whose layer names happen to overlap."""
    differ = []
    for name, info in plan.layers.items():
        shape = info.get("shape")
        mod = linears[name]
        if shape is not None and tuple(shape) != (mod.in_features, mod.out_features):
            differ.append(
                f"{name!r} ({shape[0]}x{shape[1]} in the plan, "
                f"{mod.in_features}x{mod.out_features} here)"
            )
    if differ:
        raise ValueError(
            "fp8_plan was made for another model: its layers' shapes differ from this "
            f"model's: {', '.join(differ[:5])}; make the plan with ag.fp8_plan on this model"
        )


def _warn_unconvertible(model: nn.Module, names: list[str]) -> None:
    shown = ", ".join(n or "(root)" for n in names[:6]) + (", ..." if len(names) > 6 else "")
    conv1d = any(is_hf_conv1d(m) for m in model.modules())
    warnings.warn(
        f"precision='fp8': {len(names)} module(s) do matmuls but are not nn.Linear, so they "
        f"stay in bf16 ({shown}; guard.fp8.unconvertible lists them)"
        + (f". Fix for transformers Conv1D: {CONV1D_FIX}" if conv1d else ""),
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def _warn_emulated(device: torch.device) -> None:
    if device.type in _warned_emulation:
        return
    _warned_emulation.add(device.type)
    warnings.warn(
        f"precision='fp8' on {device.type}: this device has no fp8 matmul, so torchao "
        "emulates it (real fp8 casts, the matmul in high precision): numerics as on an "
        "fp8 GPU, speed not",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


OWN_SAMPLE_EVERY = 10  # steps between samples of a rescue that has no run log to follow
OWN_SAMPLES_KEPT = 64  # samples such a rescue keeps in memory (the findings read them)


class _OwnSchedule:
    """The fp8 monitor's log when there is no telemetry: a fixed sampling period and nowhere
    to write (the samples stay in the monitor, the rescues in ``diagnostics()``)."""

    closed = False

    def __init__(self, every: int) -> None:
        self.range_every = every

    def append_events(self, records: list[dict[str, Any]]) -> None:
        del records  # no run log: nothing is written

    def annotate(self, key: str, value: Any) -> None:
        del key, value
