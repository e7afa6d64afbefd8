"""The variants :func:`ampguard.compare` trains, and how one variant's run goes.

Every variant starts from :func:`fresh` (the RNGs seeded, the factory called again), so all of
them see the same weights and batches; :func:`run_variant` trains it and records its losses,
skips, final scale and timing. Cost: ``steps`` training steps and one host read of the losses.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ampguard import precisions
from ampguard.core.policy import dtype_of
from ampguard.core.scaler import ScalerConfig
from ampguard.experiments import _fp8, _lowp, _stall, _verdict
from ampguard.experiments._results import Experiment, VariantResult
from ampguard.experiments._timing import StepClock
from ampguard.precisions import REGISTRY

__all__ = [
    "BASELINE",
    "FIXED_SCALE",
    "LOWP_REFERENCE",
    "PRECISION_OF",
    "VARIANTS",
    "fresh",
    "run_variant",
    "seed_all",
    "stream",
]

VARIANTS: dict[str, str] = {
    "fp32": "fp32 baseline (autocast off)",
    "fp16_dynamic": "fp16 autocast, dynamic loss scaling",
    "fp16_fixed": "fp16 autocast, fixed loss scale 64 (never updated)",
    "bf16": "bf16 autocast, no loss scaler",
    "fp16_noscaler": "fp16 autocast, no loss scaler (plain loop)",
}
PRECISION_OF: dict[str, str] = precisions.checked(
    {
        "fp32": "fp32",
        "fp16_dynamic": "fp16",
        "fp16_fixed": "fp16",
        "bf16": "bf16",
        "fp16_noscaler": "fp16",
        **dict.fromkeys(_fp8.FP8_VARIANTS, "fp8"),
        **{n: n for n in _lowp.LOWP_VARIANTS},  # a precision that is one format: its name
    },
    source="compare's variants",
)
"""The registered precision each variant trains in (its facts decide the Guard): a variant is
a precision's name, or the name with what it varies (``fp16_fixed``, ``fp8_planned``)."""
BASELINE = next(n for n, p in PRECISION_OF.items() if REGISTRY[p].is_full)  # "fp32"
# the variant the fp8 and block-scaled variants are judged against: plain bf16 autocast
LOWP_REFERENCE = next(
    n
    for n, p in PRECISION_OF.items()
    if REGISTRY[p].autocast_only and REGISTRY[p].autocast_dtype == "bfloat16"
)
NO_SCALER = "fp16_noscaler"  # the plain loop: autocast without a Guard or a loss scaler
_PLAIN_DTYPE = dtype_of(REGISTRY[PRECISION_OF[NO_SCALER]].autocast_dtype)
FIXED_SCALE = 64.0


def seed_all(seed: int) -> None:
    """Seed Python's, torch's and numpy's RNGs (what compare does before each variant)."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def fresh(factory: Callable[[], Experiment], seed: int) -> Experiment:
    seed_all(seed)
    exp = factory()
    if not isinstance(exp, Experiment):
        raise TypeError(f"factory() must return an ampguard.Experiment, got {type(exp).__name__}")
    return exp


def stream(batches: Iterable[Any], steps: int) -> Iterator[Any]:
    """``steps`` batches, cycling re-iterable inputs; stops when a one-shot iterator ends."""
    it = iter(batches)
    reiterable = it is not batches
    n = 0
    while n < steps:
        try:
            batch = next(it)
        except StopIteration:
            if not reiterable or n == 0:
                return
            it = iter(batches)
            continue
        n += 1
        yield batch


def _make_guard(name: str, exp: Experiment, scaler: ScalerConfig | None, plan: Any = None) -> Any:
    from ampguard.guard import Guard

    if name in _fp8.FP8_VARIANTS:
        return Guard(
            exp.model,
            exp.optimizer,
            precision=PRECISION_OF[name],
            fp8_plan=plan if name == "fp8_planned" else None,
        )
    if name in _lowp.LOWP_VARIANTS:  # the layers are emulated in the format (see run_variant)
        return Guard(exp.model, exp.optimizer, precision="bf16", skip_nonfinite=False)
    precision = PRECISION_OF[name]
    if not REGISTRY[precision].needs_scaler:  # what it does itself: non-finite steps applied
        return Guard(exp.model, exp.optimizer, precision=precision, skip_nonfinite=False)
    cfg = scaler or ScalerConfig()
    if name == "fp16_fixed":
        cfg = ScalerConfig(init_scale=FIXED_SCALE, dynamic=False)
    # Collapses become skipped steps, so every variant yields a full loss curve.
    cfg = dataclasses.replace(cfg, on_collapse="warn")
    return Guard(exp.model, exp.optimizer, precision=precision, scaler=cfg)


def run_variant(
    factory: Callable[[], Experiment],
    name: str,
    steps: int,
    seed: int,
    scaler: ScalerConfig | None,
    bar: Any,
    capture: dict[str, Any],
    plan: Any = None,
) -> VariantResult:
    exp = fresh(factory, seed)
    res = VariantResult(name, {**VARIANTS, **_fp8.FP8_VARIANTS, **_lowp.LOWP_VARIANTS}[name], [])
    if name in _lowp.LOWP_VARIANTS:
        res.converted = _lowp.prepare(name, exp.model)
    guard = None if name == NO_SCALER else _make_guard(name, exp, scaler, plan)
    device_type = next(p.device.type for p in exp.model.parameters())
    losses: list[torch.Tensor] = []
    last = None
    clock = StepClock(device_type)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for i, batch in enumerate(stream(exp.batches, steps)):
                last = batch
                losses.append(_step(exp, guard, batch, device_type, res, i, capture))
                clock.tick()
                if bar is not None:
                    bar.update(1)
    except Exception as exc:  # noqa: BLE001 - an AMP variant failing is a result, not a crash
        if name == BASELINE:
            raise
        res.error = f"{type(exc).__name__}: {exc}"
    res.seconds, res.timed_steps, res.step_seconds = clock.stop()
    res.losses = torch.stack(losses).tolist() if losses else []
    res.params_finite = all(bool(torch.isfinite(p).all()) for p in exp.model.parameters())
    if guard is not None and REGISTRY[PRECISION_OF[name]].needs_scaler:
        res.final_scale = guard.scale
    if name in _stall.STALL_ORDER and last is not None and res.error is None:
        # a silent stall is judged later: keep what locate needs to name its layer
        _stall.capture(capture.setdefault("last", {}), name, exp, last, res.final_scale or 1.0)
    bad = [i + 1 for i, x in enumerate(res.losses) if not _verdict.finite(x)]
    if bad and (res.first_bad_step is None or bad[0] < res.first_bad_step):
        res.first_bad_step = bad[0]
    return res


def _step(
    exp: Experiment,
    guard: Any,
    batch: Any,
    device_type: str,
    res: VariantResult,
    index: int,
    capture: dict[str, Any],
) -> torch.Tensor:
    """One training step of a variant; records skips; returns the detached loss (no sync)."""
    if guard is None:
        loss = _plain_step(exp, batch, device_type)
    else:
        loss, skipped = _guarded_step(exp, guard, batch)
        if skipped:
            res.skipped += 1
            res.skipped_at.append(index + 1)
            res.first_bad_step = res.first_bad_step or index + 1
            if res.name == "fp16_fixed" and "batch" not in capture:
                _capture(capture, exp, batch, index)
    return loss.detach().float().reshape(())


def _plain_step(exp: Experiment, batch: Any, device_type: str) -> torch.Tensor:
    with torch.autocast(device_type, dtype=_PLAIN_DTYPE):
        loss = exp.loss_fn(exp.model, batch)
    loss.backward()
    exp.optimizer.step()
    exp.optimizer.zero_grad(set_to_none=True)
    return loss


def _guarded_step(exp: Experiment, guard: Any, batch: Any) -> tuple[torch.Tensor, bool]:
    with guard.autocast():
        loss = exp.loss_fn(exp.model, batch)
    guard.backward(loss)
    result = guard.step()
    return loss, result.overflow


def _capture(capture: dict[str, Any], exp: Experiment, batch: Any, index: int) -> None:
    # The overflowing step was skipped, so the weights are still those that met this batch.
    capture["index"] = index
    capture["batch"] = copy.deepcopy(batch)
    capture["state"] = {k: v.detach().clone() for k, v in exp.model.state_dict().items()}
