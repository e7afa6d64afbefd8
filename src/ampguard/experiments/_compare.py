"""``compare``: train every variant from identical weights and data, and judge them.

The variants run in :mod:`ampguard.experiments._variants`; the verdict is
:mod:`ampguard.experiments._verdict`'s, the fp8 and emulated low-precision verdicts
:mod:`~ampguard.experiments._fp8`'s and :mod:`~ampguard.experiments._lowp`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ampguard._util.checks import check_int
from ampguard.core.scaler import ScalerConfig
from ampguard.experiments import _fp8, _lowp, _stall, _verdict
from ampguard.experiments._results import Comparison, Experiment, VariantResult
from ampguard.experiments._variants import (
    BASELINE,
    FIXED_SCALE,
    LOWP_REFERENCE,
    PRECISION_OF,
    VARIANTS,
    fresh,
    run_variant,
    stream,
)

__all__ = ["compare"]


def compare(
    factory: Callable[[], Experiment],
    steps: int = 300,
    variants: Sequence[str] | None = None,
    progress: bool = True,
    *,
    scaler: ScalerConfig | None = None,
    seed: int = 0,
) -> Comparison:
    """Train every variant from identical weights and data; return a :class:`Comparison`.

    ``variants`` picks from :data:`VARIANTS` (default all; ``"fp32"`` always runs, it is the
    baseline). ``scaler`` configures the dynamic fp16 variant (default ``ScalerConfig()``); its
    collapses are recorded as skipped steps instead of raising. Errors raised by the fp32
    baseline propagate (the experiment itself is broken); an AMP variant that raises is recorded
    as failed with the error.

    Cost: ``steps`` training steps per variant, plus at most one ``ampguard.locate`` run, and
    a copy of each low-precision variant's final weights, optimizer state and last batch (what a
    ``silent_stall``'s ``locate`` replays); with an fp8 variant, one fp8 plan and a second bf16
    run (``seed + 1``: bf16's run-to-run noise, against which fp8 is judged).

    >>> cmp = ag.compare(make_experiment, steps=200)
    >>> cmp.verdict, cmp.fix
    ('amp_ok', '')
    """
    names = _check_args(factory, steps, variants, scaler)
    fp8 = any(n in _fp8.FP8_VARIANTS or n in _lowp.LOWP_VARIANTS for n in names)
    bar = _progress(progress, steps * (len(names) + fp8))
    results: dict[str, VariantResult] = {}
    capture: dict[str, Any] = {}
    plan = _fp8_plan(factory, seed, names)
    bf16_again = None
    try:
        for name in names:
            if bar is not None:
                bar.set_description(name)
            results[name] = run_variant(factory, name, steps, seed, scaler, bar, capture, plan)
        if fp8:  # bf16's run-to-run noise, the yardstick of the fp8 verdict
            if bar is not None:
                bar.set_description("bf16 (seed + 1)")
            bf16_again = run_variant(factory, "bf16", steps, seed + 1, scaler, bar, {}, None)
    finally:
        if bar is not None:
            bar.close()
    cmp = Comparison(results, *_verdict.judge(results, steps), steps)
    _fp8.judge_fp8(cmp, plan, bf16_again)
    _lowp.judge_lowp(cmp, bf16_again)
    if cmp.verdict == "fp16_range" and "batch" in capture:
        cmp.failing_batch = capture["index"]
        cmp.explanation += (
            f" First failing batch: #{cmp.failing_batch} (step "
            f"{cmp.failing_batch + 1} of the fixed-scale run)."
        )
        _locate(cmp, factory, seed, capture)
    if cmp.verdict == "silent_stall":  # the per-layer evidence of the stalled variant
        picked = _stall.pick(results, _verdict.TAIL_RTOL, _verdict.MAX_SKIP_FRACTION)
        if picked is not None and picked[0] in capture.get("last", {}):
            from ampguard.forensics import locate

            _stall.evidence(
                cmp, picked[0], lambda: fresh(factory, seed), capture["last"][picked[0]], locate
            )
    return cmp


def _check_args(factory: Any, steps: Any, variants: Any, scaler: Any) -> list[str]:
    if not callable(factory):
        raise TypeError(
            f"factory must be a callable returning an ampguard.Experiment, got "
            f"{type(factory).__name__}"
        )
    check_int("steps", steps)
    if scaler is not None and not isinstance(scaler, ScalerConfig):
        raise TypeError(
            f"scaler must be an ampguard.ScalerConfig or None, got {type(scaler).__name__}"
        )
    if variants is None:
        return list(VARIANTS)
    known = (*VARIANTS, *_fp8.FP8_VARIANTS, *_lowp.LOWP_VARIANTS)
    if isinstance(variants, str) or not all(isinstance(v, str) for v in variants):
        raise TypeError(f"variants must be a sequence of variant names from {known}")
    unknown = [v for v in variants if v not in known]
    if unknown:
        raise ValueError(f"variants must be names from {known}, got unknown {unknown}")
    fp8 = any(v in _fp8.FP8_VARIANTS or v in _lowp.LOWP_VARIANTS for v in variants)  # bf16: ref
    chosen = [n for n in known if n == BASELINE or n in variants or (fp8 and n == LOWP_REFERENCE)]
    if len(chosen) < 2:
        raise ValueError("variants must name at least one variant besides the fp32 baseline")
    return chosen


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="step", leave=False)


def _fp8_plan(factory: Callable[[], Experiment], seed: int, names: list[str]) -> Any:
    """The fp8 plan on the first batch of a fresh experiment when an fp8 variant runs."""
    from ampguard.fp8 import require_torchao

    if not any(n in _fp8.FP8_VARIANTS for n in names):
        return None
    require_torchao()
    exp = fresh(factory, seed)
    first = next(stream(exp.batches, 1), None)
    return None if first is None else _fp8.make_plan(exp, first)


def _locate(
    cmp: Comparison, factory: Callable[[], Experiment], seed: int, capture: dict[str, Any]
) -> None:
    """Run ``ampguard.locate`` on the first failing batch, at the fixed variant's scale."""
    from ampguard.forensics import locate

    exp = fresh(factory, seed)
    exp.model.load_state_dict(capture["state"])
    precision = PRECISION_OF["fp16_fixed"]
    try:
        cmp.diagnosis = locate(
            exp.model, exp.loss_fn, capture["batch"], precision=precision, scale=FIXED_SCALE
        )
    except Exception as exc:  # noqa: BLE001 - the comparison stands without a diagnosis
        cmp.locate_error = f"locate failed: {type(exc).__name__}: {exc}"
        return
    _verdict.add_diagnosis(cmp)
