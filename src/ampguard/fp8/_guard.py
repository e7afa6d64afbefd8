"""``Guard(precision="fp8")``: torchao float8 training for the Linear layers a plan allows.

When no layer is converted (none eligible, or the plan keeps them all in bf16) the Guard trains
in bf16 and says so: ``guard.precision == "bf16"`` (the run log records ``precision: "bf16"``,
``requested_precision: "fp8"``) and a ``RuntimeWarning`` at construction.

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

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ampguard.core.policy import resolve_precision
from ampguard.fp8._modules import CONV1D_FIX, is_hf_conv1d, unconvertible

__all__ = [
    "Fp8UnavailableError",
    "require_torchao",
    "Fp8State",
    "attach",
    "eligible",
    "has_fp8_matmul",
    "TORCHAO_PIN",
]

TORCHAO_PIN = "torchao==0.18.0"
_MULTIPLE = 16
_QUIET = ("torchao", "torch.utils._pytree", "torch._dynamo")
_warned_emulation: set[str] = set()


class Fp8UnavailableError(ImportError):
    """torchao (the fp8 training kernels) is not installed or cannot be imported."""


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in _QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def require_torchao() -> Any:
    """Import and return ``torchao.float8``, or raise :class:`Fp8UnavailableError` saying what
    to install."""
    try:
        with _quiet_logs(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8 as float8
    except ImportError as exc:
        raise Fp8UnavailableError(
            f"precision='fp8' needs torchao (fp8 training): pip install \"ampguard[fp8]\" "
            f"(installs {TORCHAO_PIN}); import failed: {exc}"
        ) from exc
    return float8


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
    """What the Guard keeps about its fp8 layers: the plan, the converted names, emulation."""

    def __init__(self, guard: Any, plan: Any) -> None:
        from ampguard.fp8 import Fp8Plan

        if plan is not None and not isinstance(plan, Fp8Plan):
            raise TypeError(
                f"fp8_plan must be an ampguard.Fp8Plan (from ag.fp8_plan) or None, "
                f"got {type(plan).__name__}"
            )
        float8 = require_torchao()
        model: nn.Module = guard.model
        self.plan = plan
        self.recipe = plan.recipe if plan is not None else "tensorwise"
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        if plan is not None:
            unknown = sorted(set(plan.layers) - set(linears))
            if unknown:
                raise ValueError(
                    f"fp8_plan was made for another model: its layers {unknown[:5]} "
                    "are not Linear layers of this model"
                )
        self.emulated = not has_fp8_matmul(guard._device)
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self.emulated:
            config = dataclasses.replace(config, emulate=True)
            _warn_emulated(guard._device)
        chosen = {n for n, m in linears.items() if self._wanted(m, n, float8)}
        if chosen:
            with _quiet_logs():
                float8.convert_to_float8_training(
                    model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen
                )
        self.layers = [
            n for n, m in model.named_modules() if isinstance(m, float8.float8_linear.Float8Linear)
        ]
        self.kept = [n for n in linears if n not in self.layers]
        self.unconvertible = list(unconvertible(model))  # matmuls that are not nn.Linear
        if self.unconvertible:
            _warn_unconvertible(model, self.unconvertible)
        if not self.layers:
            # nothing computes in fp8: the Guard says what runs (bf16), not what was asked
            guard._policy = resolve_precision("bf16", guard._device)
            warnings.warn(
                "precision='fp8': no Linear layer is converted to fp8 (none eligible, "
                "or the plan keeps them all in bf16); training runs in bf16 "
                "(guard.precision is 'bf16', guard.requested_precision 'fp8')",
                RuntimeWarning,
                stacklevel=4,
            )
        self.monitor: Any = None

    def watch(self, guard: Any) -> None:
        """With telemetry (``range_every`` > 0), sample the converted layers while training."""
        if guard._telemetry is None or not guard._telemetry.range_every or not self.layers:
            return
        from ampguard.fp8._stats import Fp8Monitor

        th = self.plan.thresholds if self.plan is not None else None
        self.monitor = Fp8Monitor(guard, self.layers, self.recipe, th)

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
        return out

    def findings(self) -> list[Any]:
        """AG111/AG112 from the telemetry samples (empty without telemetry)."""
        if self.monitor is None:
            return []
        found = self.monitor.findings()
        self.monitor.telemetry.annotate("fp8", self.summary())  # the report's fp8 section
        return found


def _warn_unconvertible(model: nn.Module, names: list[str]) -> None:
    shown = ", ".join(n or "(root)" for n in names[:6]) + (", ..." if len(names) > 6 else "")
    conv1d = any(is_hf_conv1d(m) for m in model.modules())
    warnings.warn(
        f"precision='fp8': {len(names)} module(s) do matmuls but are not nn.Linear, so they "
        f"stay in bf16 ({shown}; guard.fp8.unconvertible lists them)"
        + (f". Fix for transformers Conv1D: {CONV1D_FIX}" if conv1d else ""),
        RuntimeWarning,
        stacklevel=5,
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
        stacklevel=5,
    )


def attach(guard: Any, plan: Any) -> Fp8State | None:
    """Convert ``guard.model``'s Linear layers for ``precision='fp8'``; None otherwise."""
    if guard._policy.precision != "fp8":
        if plan is not None:
            raise ValueError(
                f"fp8_plan is only used with precision='fp8', got "
                f"precision={guard._requested_precision!r}"
            )
        return None
    return Fp8State(guard, plan)
