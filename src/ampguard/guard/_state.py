"""The Guard's state dict: what it saves, and loading it (check everything, then apply).

:func:`to_dict` builds :meth:`Guard.state_dict` (format version :data:`STATE_VERSION`: states
saved by earlier releases load unchanged). :func:`check` reads such a state and returns a
:class:`Plan`, raising ``ValueError`` for anything malformed *before* the Guard is touched;
:func:`apply` then carries the plan out. So a ``Guard.load_state_dict`` that raises changes
nothing.

The precision rule: the precision given to the Guard's constructor is the user's intent and wins,
with one exception: a state that recorded an automatic fallback (``on_collapse='fallback'``) away
from that same precision resumes the fallback. Either way a precision change is warned about,
naming both precisions and what happens to the loss scale.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from ampguard import precisions
from ampguard._util.checks import is_int, is_number
from ampguard._util.stack import user_stacklevel
from ampguard.core import results
from ampguard.core.policy import PrecisionPolicy, resolve_precision
from ampguard.guard import _flags
from ampguard.guard._fp8 import UNCONVERTED
from ampguard.guard._step_state import StepState
from ampguard.replay import SpikeDetector

__all__ = ["Plan", "to_dict", "check", "apply", "STATE_VERSION"]

STATE_VERSION = 1


def to_dict(state: StepState, resume: dict[str, Any]) -> dict[str, Any]:
    """The Guard state of ``state`` (``resume``: the resume tracker's state). Settle pending
    flags first. Cost: one host sync with a loss scale (its state)."""
    return {
        "version": STATE_VERSION,
        "precision": state.policy.precision,
        "requested_precision": state.requested_precision,
        "fallback": dict(state.fallback) if state.fallback else None,
        "scaler": state.loss_scale.state_dict(),
        "scaler_config": state.config.to_dict(),
        "steps": state.steps,
        "accumulation_steps": state.accumulation_steps,
        "counters": state.counts.to_dict(),
        "scale_history": state.history.state_dict(),
        "resume": resume,
        "forensics": state.forensics.state() if state.forensics is not None else None,
        "fp8": state.fp8.state() if state.fp8 is not None else None,
        "rescue": state.rescue.state() if state.rescue is not None else None,
        "spikes": state.spikes.state() if state.spikes is not None else None,
    }


def _uses_scale(precision: str) -> bool:
    entry = precisions.REGISTRY.get(precision)
    return entry is not None and entry.needs_scaler


def _converts(precision: Any) -> bool:
    entry = precisions.REGISTRY.get(precision) if isinstance(precision, str) else None
    return entry is not None and entry.hook is not None


@dataclass
class Plan:
    """What a checked Guard state will set; built without touching the Guard."""

    steps: int
    counters: results.Counters
    fallback: dict[str, Any] | None
    policy: PrecisionPolicy
    scaler: dict[str, Any] | None  # the saved scaler state to load, or None
    restart_scale: bool  # the Guard uses a scaler and the state has none to give (precision change)
    history: dict[str, Any] | None
    forensics: dict[str, Any] | None
    resume: dict[str, Any] | None
    config_diff: dict[str, Any]
    precision_note: str | None
    fp8_rescued: list[dict[str, Any]] | None = None
    rescue: dict[str, Any] | None = None  # the stagnation rescue's buffers (guard._rescue)
    spikes: dict[str, Any] | None = None  # the loss-spike detector's statistic


def _bad(field: str, rule: str, value: Any) -> ValueError:
    text = repr(value)
    return ValueError(
        f"malformed Guard state: {field!r} {rule}, got "
        f"{text if len(text) <= 80 else text[:77] + '...'}"
    )


def _int(state: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    value = state.get(key)
    if not is_int(value) or value < minimum:
        raise _bad(key, f"must be an int >= {minimum}", value)
    return value


def _dict(value: Any, field: str, *, optional: bool = True) -> dict[str, Any] | None:
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise _bad(field, "must be a dict" + (" or None" if optional else ""), value)
    return value


def _positive(value: Any) -> bool:
    return is_number(value) and math.isfinite(value) and value > 0


# ---------------------------------------------------------------------- check
def check(guard: StepState, state: Any) -> Plan:
    """Validate ``state`` for the Guard whose step state is ``guard``; raises ``ValueError``
    naming the bad field."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(
            f"not an ampguard Guard state (expected a dict with version={STATE_VERSION})"
        )
    for key in ("precision", "scaler", "scaler_config", "steps", "counters", "fallback"):
        if key not in state:
            raise ValueError(f"malformed Guard state: missing field {key!r}")
    saved = state["precision"]
    _check_fp8(guard, saved)  # fp8 <-> other precisions: refused, nothing changed
    if saved not in precisions.names():
        raise _bad("precision", f"must be one of {precisions.names()}", saved)
    fallback = _check_fallback(state["fallback"])
    scaler = _check_scaler(state["scaler"])
    if _uses_scale(saved) and scaler is None:
        raise ValueError(f"malformed Guard state: saved in {saved} but holds no scaler state")
    config = _dict(state["scaler_config"], "scaler_config", optional=False)
    assert config is not None
    policy, note = _precision(guard, saved, fallback, scaler)
    uses_scaler = policy.needs_scaler
    keep_scale = uses_scaler and _uses_scale(saved)
    return Plan(
        steps=_int(state, "steps"),
        counters=_check_counters(state["counters"]),
        fallback=fallback if policy.precision == saved else None,
        policy=policy,
        scaler=scaler if keep_scale else None,
        restart_scale=uses_scaler and not keep_scale,
        history=_check_history(guard, state.get("scale_history"))
        if policy.precision == saved
        else None,
        forensics=_check_forensics(guard, state.get("forensics")),
        resume=_check_resume(state.get("resume")),
        config_diff={k: v for k, v in config.items() if getattr(guard.config, k, v) != v},
        precision_note=note,
        fp8_rescued=guard.fp8.check_state(state.get("fp8")) if guard.fp8 is not None else None,
        rescue=guard.rescue.check_state(state.get("rescue")) if guard.rescue is not None else None,
        spikes=(
            SpikeDetector.check_state(state["spikes"])
            if guard.spikes is not None and state.get("spikes") is not None
            else None
        ),
    )


def _check_fallback(value: Any) -> dict[str, Any] | None:
    fb = _dict(value, "fallback")
    if fb is None:
        return None
    if fb.get("from") not in precisions.names() or fb.get("to") not in precisions.names():
        raise _bad("fallback", f"must name 'from' and 'to' precisions in {precisions.names()}", fb)
    _int(fb, "step")
    return dict(fb)


def _check_scaler(value: Any) -> dict[str, Any] | None:
    sc = _dict(value, "scaler")
    if sc is None:
        return None
    if not _positive(sc.get("scale")):
        raise _bad("scaler.scale", "must be a finite number > 0", sc.get("scale"))
    _int(sc, "growth_tracker")
    if "hysteresis_tracker" in sc:
        _int(sc, "hysteresis_tracker")
    return sc


def _check_counters(value: Any) -> results.Counters:
    data = _dict(value, "counters", optional=False)
    assert data is not None
    for key in results.Counters().to_dict():
        if key in data:
            _int(data, key)
    return results.Counters.from_dict(data)


def _check_history(guard: StepState, value: Any) -> dict[str, Any] | None:
    hist = _dict(value, "scale_history")
    if hist is None:  # absent in states saved before it was kept
        return None
    values = hist.get("values")
    if (
        not isinstance(values, list)
        or len(values) != guard.history.size
        or not all(_positive(v) for v in values)
    ):
        raise _bad(
            "scale_history.values",
            f"must be a list of {guard.history.size} finite numbers > 0",
            values,
        )
    _int(hist, "changes")
    return hist


def _check_forensics(guard: StepState, value: Any) -> dict[str, Any] | None:
    data = _dict(value, "forensics")
    if data is None or guard.forensics is None:
        return None
    names, changes = data.get("keep_fp32", []), data.get("changes", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _bad("forensics.keep_fp32", "must be a list of module names", names)
    modules = dict(guard.model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise _bad(
            "forensics.keep_fp32",
            f"names modules {type(guard.model).__name__} does not have",
            unknown,
        )
    if not isinstance(changes, list) or not all(isinstance(c, dict) for c in changes):
        raise _bad("forensics.changes", "must be a list of dicts", changes)
    return data


def _check_resume(value: Any) -> dict[str, Any] | None:
    data = _dict(value, "resume")
    if data is not None and data.get("ramp_start") is not None:
        _int(data, "ramp_start")
    return data


# ---------------------------------------------------------------------- the precision rule
def _precision(
    guard: StepState, saved: str, fallback: dict[str, Any] | None, scaler: dict[str, Any] | None
) -> tuple[PrecisionPolicy, str | None]:
    device = guard.device
    intent = resolve_precision(guard.requested_precision, device).precision
    if _converts(intent) and guard.fp8 is not None and not guard.fp8.layers:
        intent = UNCONVERTED  # a conversion asked, no layer converted: the Guard trains in bf16
    if saved == intent:
        return resolve_precision(intent, device), None
    asked = f"precision={guard.requested_precision!r}"
    if fallback is not None and fallback["from"] == intent and fallback["to"] == saved:
        policy = resolve_precision(saved, device)  # ValueError if this device lacks it
        return policy, (
            f"Guard state records an automatic fallback {intent} -> {saved} at step "
            f"{fallback['step']} from the precision this Guard was given ({asked}); the run "
            f"resumes in {saved} as it was saved, without a loss scale. Construct the Guard "
            f"with precision={saved!r} to make it explicit."
        )
    head = (
        f"Guard state was saved in {saved}, this Guard was given {asked} ({intent}); "
        f"training continues in {intent} (the constructor's precision wins)"
    )
    if _uses_scale(intent):
        tail = (
            f" and the loss scale starts at init_scale={guard.config.init_scale:g}, "
            "probing its level again (AG107). Consider a lower learning rate for a few "
            "hundred steps (ResumeWarmup)."
        )
    elif _uses_scale(saved):
        scale = scaler["scale"] if scaler else None
        tail = (
            f"; the saved {saved} loss scale ({scale:g}) is dropped: {intent} needs none."
            if scale is not None
            else f"; {intent} needs no loss scale."
        )
    else:
        tail = "; neither precision uses a loss scale."
    return resolve_precision(intent, device), head + tail


# ---------------------------------------------------------------------- apply
def apply(guard: StepState, plan: Plan) -> float | None:
    """Carry out a checked plan (see :func:`check`); returns the saved scale (None without one).
    The Guard then records the resume (its run log and resume tracker)."""
    if plan.config_diff:
        warnings.warn(
            f"Guard state was saved with a different ScalerConfig {plan.config_diff}; "
            "keeping the config given to this Guard",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
    guard.steps = plan.steps
    if guard.signatures is not None:  # the window that begins now, by the restored count
        guard.signatures.window(guard.steps)
    guard.counts = plan.counters
    guard.fallback = plan.fallback
    if guard.micro:  # a half-finished window: its gradients must not join the next one
        for opt in guard.optimizers:
            opt.zero_grad(set_to_none=True)
        guard.contain = None  # containment buffer: rebuilt on the next backward
        if guard.telemetry is not None:
            guard.telemetry.on_abort()
    guard.micro = 0
    guard.window_losses = []
    _flags.drain(guard, act=False)  # results still pending stay readable
    if plan.policy.precision != guard.policy.precision:
        guard.policy = plan.policy
        guard.loss_scale = guard.new_loss_scale()
    elif plan.restart_scale:
        guard.loss_scale = guard.new_loss_scale()
    saved = plan.scaler["scale"] if plan.scaler is not None else None
    if guard.scaled and plan.scaler is not None:
        guard.loss_scale.load_state_dict(plan.scaler)
    if plan.restart_scale:
        guard.history.reset(guard.config.init_scale)
    else:
        guard.history.reset(saved if saved is not None else 1.0)
    if plan.history is not None:
        guard.history.load_state_dict(plan.history)
    if guard.forensics is not None:  # modules kept in fp32 stay in fp32 after a resume
        guard.forensics.load(plan.forensics)
    if guard.fp8 is not None and plan.fp8_rescued:  # fp8 layers rescued to bf16 stay there
        guard.fp8.load(plan.fp8_rescued, guard.telemetry)
    if guard.rescue is not None and plan.rescue is not None:  # Kahan buffers, generators
        guard.rescue.load(plan.rescue)
    if guard.spikes is not None and plan.spikes is not None:  # the spike detector's statistic
        guard.spikes.detector.load_state_dict(plan.spikes)
    if plan.precision_note is not None:
        warnings.warn(plan.precision_note, RuntimeWarning, stacklevel=user_stacklevel())
    return saved


def _check_fp8(guard: StepState, saved: Any) -> None:
    """A Guard state saved under a converting precision (fp8) loads only into a Guard of that
    precision, and vice versa: the model's Linear layers are converted (or not) at
    construction, which a load cannot change."""
    now = guard.policy.precision
    if _converts(saved) != _converts(now):
        raise ValueError(
            f"the Guard state was saved with precision={saved!r} but this Guard "
            f"uses precision={now!r}; create the Guard with precision={saved!r} "
            "to resume it"
        )
