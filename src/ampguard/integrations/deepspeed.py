"""DeepSpeed: watch a ``DeepSpeedEngine`` (or DeepSpeed's own loss scaler) without changing it.

A DeepSpeed loop (the engine needs a process group, so this is not a doctest; the real run is
``tests/test_deepspeed.py``)::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    with ampguard.integrations.deepspeed.watch(engine, telemetry="runs/ds") as handle:
        for x, y in data:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
    handle.report()               # runs/ds/report.html: scale, skips, grad norms, per-layer stats

Both are implementations of attach mode's seam (:mod:`ampguard.integrations._seam`):

* :class:`EngineScaler` watches an engine: the loss handed to ``engine.backward``, the model's
  gradients when the last backward of an accumulation window ends (before DeepSpeed unscales,
  clips or moves them into its flat fp32 buffers), and each model step from ``engine.step``:
  skipped where ``engine.was_step_applied()`` is False (fp16 overflow, or a non-finite bf16 step
  DeepSpeed skips), the engine's own unscaled ``get_global_grad_norm()`` and its loss scale (the
  optimizer's ``loss_scale``, a host float).
* :class:`LossScalerWatch` watches DeepSpeed's ``DynamicLossScaler`` / ``LossScaler`` object in a
  loop that drives it by hand (Megatron style: ``backward`` -> ``has_overflow`` ->
  ``update_scale(overflow)`` -> unscale and step): ``ag.watch(loss_scaler, model, optimizer,
  telemetry)`` finds it through the seam's adapters.

Nothing DeepSpeed computes is changed (methods are wrapped on the instance and called through;
``close`` removes the wrappers). DeepSpeed keeps its own floor and hysteresis (``min_loss_scale``,
``hysteresis``): ampguard's attach-mode guard features are refused here. Cost: no host sync per
step beyond DeepSpeed's own (it reads the overflow flag and the grad norm to the host itself).

ZeRO stage 3 partitions the parameters themselves: the model's tensors are empty outside the
forward, so there is no per-layer gradient to sample; the scale, the skips, the loss and the
engine's grad norm are recorded as at every stage. On a CPU, ``deepspeed.initialize``
JIT-compiles a C++ op (:mod:`ampguard.integrations._deepspeed_jit`): importing this module
before it warns, with what to do.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ampguard import precisions
from ampguard.guard import DEFAULT_CAPACITY
from ampguard.integrations._backward_end import BackwardEnd, nonfinite_flag
from ampguard.integrations._extras import require
from ampguard.integrations._recorder import RecorderOptions
from ampguard.integrations._seam import NOT_MINE, ScalerListener, StepOutcome
from ampguard.integrations._skip import CANNOT_SKIP
from ampguard.integrations.watch import Watch

require("deepspeed", "ampguard.integrations.deepspeed")

from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import LossScalerBase  # noqa: E402

from ampguard.integrations._deepspeed_jit import shm_op_warning  # noqa: E402

_JIT = shm_op_warning()  # DeepSpeed on CPU: the C++ op deepspeed.initialize would build
if _JIT is not None:
    warnings.warn(_JIT, RuntimeWarning, stacklevel=2)

__all__ = ["watch", "EngineScaler", "LossScalerWatch", "engine_precision", "watchable"]

_MARK = "__ampguard_deepspeed__"


def watch(
    engine: Any,
    telemetry: Any,
    *,
    flight_recorder: int | bool = DEFAULT_CAPACITY,
    on_spike: str | None = "warn",
) -> Watch:
    """Attach ampguard to a ``DeepSpeedEngine``; return the :class:`~ampguard.integrations.watch.
    Watch` handle (``findings()``, ``report()``, ``close()``; a context manager).

    ``engine``: what ``deepspeed.initialize`` returned first (with an optimizer).
    ``telemetry``: a run folder or an :class:`ampguard.Telemetry`. The precision is the engine's
    (``fp16``, ``bf16`` or fp32). Per-layer statistics need the model's gradients in
    ``param.grad`` when backward ends: ZeRO stages 0 and 1, and stage 2 where DeepSpeed leaves
    them there; stage 3 partitions the parameters themselves, so it records no per-layer
    statistics. At every stage the scale, the skips, the loss and the engine's grad norm are
    recorded. ``flight_recorder`` and ``on_spike`` as in :func:`ampguard.watch`: spikes are
    detected, recorded (AG180) and dumped, but ``engine.step()`` owns the update, so
    ``on_spike="skip"`` / ``"rewind"`` / ``"raise"`` warn once and then act as ``"warn"``;
    ``ampguard.triage`` is not available (the engine owns the forward). Cost: as
    :func:`ampguard.watch`.
    """
    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(
            "engine must be a deepspeed.DeepSpeedEngine (the first value deepspeed.initialize "
            f"returns), got {type(engine).__name__}"
        )
    if engine.optimizer is None:
        raise ValueError("engine has no optimizer: pass one (or an optimizer config) to initialize")
    precision = engine_precision(engine)
    return Watch(
        EngineScaler(engine),
        engine.module,
        engine.optimizer,
        telemetry,
        precision=precision,
        framework="deepspeed",
        loss_from_scaler=True,
        requested_precision=precision,
        clip_grad_norm=float(engine.gradient_clipping() or 0.0) or None,  # the engine clips
        recorder=RecorderOptions(flight_recorder, on_spike),
    )


def engine_precision(engine: Any) -> str:
    """ampguard's precision name for the engine's config (``fp16`` / ``bf16`` sections)."""
    if engine.fp16_enabled():
        return _named("float16")
    if engine.bfloat16_enabled():
        return _named("bfloat16")
    if engine.torch_autocast_enabled():
        raise ValueError(
            "engine uses DeepSpeed's torch_autocast mode (its own torch GradScaler inside the "
            "engine), which ampguard.integrations.deepspeed does not observe; use the fp16 or "
            "bf16 config sections"
        )
    return next(n for n in precisions.names(watchable=True) if precisions.REGISTRY[n].is_full)


def watchable(obj: Any) -> Any:
    """The seam's factory for DeepSpeed objects (:data:`ampguard.integrations._seam.ADAPTERS`):
    an engine or a dynamic/static loss scaler; None for a scaler at the fixed scale 1 (no loss
    scale in use); ``NOT_MINE`` otherwise."""
    if isinstance(obj, DeepSpeedEngine):
        return EngineScaler(obj)
    if isinstance(obj, LossScalerBase):
        return LossScalerWatch(obj) if obj.dynamic or float(obj.cur_scale) != 1.0 else None
    return NOT_MINE


def _named(dtype: str) -> str:
    return next(
        n for n in precisions.names(watchable=True) if precisions.REGISTRY[n].low_dtype == dtype
    )


class _Wrappers:
    """Instance-level wrappers on one object (its ``__dict__`` shadows the class's methods),
    removed again where nobody re-wrapped them since."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.obj = obj
        self.names = names
        self._installed: dict[str, Callable[..., Any]] = {}

    @property
    def present(self) -> bool:
        """True while some Watch's wrappers are installed on the object."""
        return any(getattr(self.obj.__dict__.get(n), _MARK, False) for n in self.names)

    def install(self, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Shadow ``name`` with ``make(original)``."""
        wrapper = make(getattr(self.obj, name))
        setattr(wrapper, _MARK, True)
        self.obj.__dict__[name] = wrapper
        self._installed[name] = wrapper

    def remove(self) -> None:
        for name, wrapper in self._installed.items():
            if self.obj.__dict__.get(name) is wrapper:
                del self.obj.__dict__[name]
        self._installed.clear()


def _describe(loss_scaler: Any, scale: float) -> dict[str, Any]:
    """A DeepSpeed loss scaler's settings in ampguard's names (meta.json ``scaler``)."""
    out: dict[str, Any] = {"init_scale": scale, "dynamic": bool(loss_scaler.dynamic)}
    if loss_scaler.dynamic:
        factor = float(loss_scaler.scale_factor)
        out.update(
            growth_factor=factor,
            backoff_factor=1.0 / factor,
            growth_interval=int(loss_scaler.scale_window),
            min_scale=float(loss_scaler.min_scale),
            hysteresis=int(loss_scaler.delayed_shift),
            consecutive_hysteresis=bool(loss_scaler.consecutive_hysteresis),
        )
    return out


class LossScalerWatch:
    """DeepSpeed's loss scaler object (``DynamicLossScaler`` or the static ``LossScaler``) seen
    through the seam, for a loop that drives it by hand.

    ``scale_loss`` (which ``backward`` calls) hands over the loss; ``update_scale(overflow)``
    marks the end of a step: the gradients are sampled first (still scaled: the loop unscales
    after the update), then the update runs and the step is recorded with DeepSpeed's own
    ``overflow`` bool as the skip. The scale is ``cur_scale``, a host float.
    """

    scaled = True
    correctable = False
    cannot_skip = (
        "the loop steps its optimizer itself after DeepSpeed's update_scale(overflow), with no "
        "flag ampguard can set"
    )

    def __init__(self, loss_scaler: Any) -> None:
        self.loss_scaler = loss_scaler
        self._wrappers = _Wrappers(loss_scaler, ("scale_loss", "update_scale"))

    @property
    def name(self) -> str:
        return f"deepspeed.{type(self.loss_scaler).__name__}"

    @property
    def watched(self) -> bool:
        return self._wrappers.present

    def scale(self) -> float:
        return float(self.loss_scaler.cur_scale)

    def grad_params(self) -> Sequence[torch.Tensor] | None:
        return None

    def describe(self) -> dict[str, Any]:
        return _describe(self.loss_scaler, self.scale())

    def guard_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # DeepSpeed's loss scaler keeps its own floor and hysteresis

    def attach(self, listener: ScalerListener, watched: set[int]) -> None:
        def scale_loss(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(loss: Any) -> Any:
                if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                    listener.on_scaler_loss(loss.detach())
                return original(loss)

            return wrapper

        def update_scale(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(overflow: Any) -> Any:
                before = self.scale()
                listener.on_scaler_grads(True)  # still scaled: the loop unscales after this
                result = original(overflow)
                skipped = bool(overflow)  # DeepSpeed's own host bool: no sync here
                listener.on_scaler_update(
                    StepOutcome(dict.fromkeys(watched, skipped), skipped, before)
                )
                return result

            return wrapper

        self._wrappers.install("scale_loss", scale_loss)
        self._wrappers.install("update_scale", update_scale)

    def detach(self) -> None:
        self._wrappers.remove()


class EngineScaler:
    """A ``DeepSpeedEngine`` seen through the seam (see the module docstring).

    ``scaled`` under the fp16 config; under bf16/fp32 the scale is 1 and the engine still reports
    every step (and its skips: DeepSpeed skips a bf16 step whose grad norm is not finite).
    """

    correctable = False
    cannot_skip = CANNOT_SKIP["deepspeed"]

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._wrappers = _Wrappers(engine, ("backward", "step"))
        self._backward_end: BackwardEnd | None = None
        # under ZeRO-3 these are empty outside the forward (the data lives in ds_tensor
        # partitions): telemetry then finds no gradient to sample and records the rest
        self._params = [p for p in engine.module.parameters() if p.requires_grad]
        self._nonfinite: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return f"deepspeed.{type(self.engine.optimizer).__name__}"

    @property
    def scaled(self) -> bool:
        return bool(self.engine.fp16_enabled())

    @property
    def watched(self) -> bool:
        return self._wrappers.present

    def scale(self) -> float:
        value = getattr(self.engine.optimizer, "loss_scale", None)
        return 1.0 if value is None else float(value)

    def grad_params(self) -> Sequence[torch.Tensor]:
        return self._params  # the model's, not DeepSpeed's flat fp32 master copies

    def describe(self) -> dict[str, Any]:
        engine = self.engine
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if isinstance(scaler, LossScalerBase):  # ZeRO keeps a DeepSpeed loss scaler object
            return _describe(scaler, self.scale())
        out: dict[str, Any] = {"init_scale": self.scale(), "dynamic": engine.dynamic_loss_scale()}
        args = engine.dynamic_loss_scale_args() if engine.dynamic_loss_scale() else None
        if args:
            out.update(
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=int(args["scale_window"]),
                min_scale=float(args["min_scale"]),
                hysteresis=int(args["delayed_shift"]),
                consecutive_hysteresis=bool(args["consecutive_hysteresis"]),
            )
        return out

    def guard_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # DeepSpeed keeps its own floor and hysteresis

    def attach(self, listener: ScalerListener, watched: set[int]) -> None:
        engine = self.engine
        device = self._params[0].device if self._params else torch.device("cpu")

        def backward(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(loss: Any, *args: Any, **kwargs: Any) -> Any:
                if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                    listener.on_scaler_loss(loss.detach())
                return original(loss, *args, **kwargs)

            return wrapper

        def step(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                before, steps = self.scale(), engine.global_steps
                result = original(*args, **kwargs)
                if engine.global_steps != steps:  # a model step (the window's boundary) ran
                    self._report(listener, watched, before)
                return result

            return wrapper

        def gradients_final() -> None:
            # the autograd engine's callback: every gradient of this backward is in param.grad,
            # before DeepSpeed's epilogue reduces, unscales or moves them
            if not engine.is_gradient_accumulation_boundary():
                return
            listener.on_scaler_grads(self.scaled)
            if not self.scaled:  # one multi-tensor check: a non-finite step DeepSpeed applies
                self._nonfinite = nonfinite_flag(self._params, device)

        self._wrappers.install("backward", backward)
        self._wrappers.install("step", step)
        self._backward_end = BackwardEnd(self._params, gradients_final)

    def _report(self, listener: ScalerListener, watched: set[int], before: float) -> None:
        """The engine took a model step: skipped where it says so (host bools DeepSpeed has
        already read), with its own unscaled grad norm on an applied step."""
        engine = self.engine
        skipped = not engine.was_step_applied()
        norm = None if skipped else engine.get_global_grad_norm()
        nonfinite, self._nonfinite = self._nonfinite, None
        listener.on_scaler_update(
            StepOutcome(
                dict.fromkeys(watched, skipped),
                skipped,
                before,
                grad_norm=norm,
                nonfinite=None if skipped else nonfinite,
            )
        )

    def detach(self) -> None:
        self._wrappers.remove()
        if self._backward_end is not None:
            self._backward_end.close()
            self._backward_end = None
