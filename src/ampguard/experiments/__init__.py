"""A/B experiments: train the same model from the same weights and data in fp32, fp16 and bf16.

``compare(factory)`` automates the usual AMP troubleshooting routine. ``factory()`` returns a
fresh :class:`Experiment` each call; every variant seeds the RNGs, calls it afresh and trains
``steps`` steps. The :class:`Comparison` holds per-variant loss curves, the largest relative
deviation from fp32, throughput relative to fp32, skipped steps and the final loss scale, and a
verdict with an explanation and a fix:

- ``amp_ok`` (AG333): fp16 with dynamic scaling trains like fp32.
- ``dynamic_scale_conflict`` (AG334): dynamic scaling fails but a fixed scale of 64 trains.
- ``fp16_range`` (AG335): the fixed scale fails too: values leave fp16's range. The first
  failing batch is named and, where :mod:`ampguard.forensics` is available, ``locate`` runs on it.
- ``model_problem`` (AG336): fp32 fails too; not an AMP issue.
- ``silent_stall`` (AG367): a low-precision variant stays finite and skips little, but its loss
  ends far above fp32's at the same applied steps; ``locate`` (with ``optimizer=``) runs on its
  last batch from its final weights and names the layer (:mod:`ampguard.experiments._stall`).

Opt-in variants ``fp8`` and ``fp8_planned`` (torchao float8, see :mod:`ampguard.experiments._fp8`)
are judged against bf16 too, with verdicts ``fp8_ok``/``fp8_keep_layers``/``fp8_fails``
(AG337-AG339) naming the layers to keep out of fp8.

(The module is not called ``compare``: ``import ampguard.compare`` would then replace the
``ampguard.compare`` function with the module.)
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import math
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampguard._util.checks import check_int
from ampguard.core.scaler import ScalerConfig
from ampguard.experiments import _fp8 as _f8
from ampguard.experiments import _lowp as _lp
from ampguard.experiments import _stall
from ampguard.experiments import _verdict as _v
from ampguard.experiments._timing import StepClock
from ampguard.findings import Finding, make

__all__ = [
    "Experiment",
    "Comparison",
    "VariantResult",
    "VARIANTS",
    "VERDICTS",
    "compare",
    "seed_all",
]

VARIANTS: dict[str, str] = {
    "fp32": "fp32 baseline (autocast off)",
    "fp16_dynamic": "fp16 autocast, dynamic loss scaling",
    "fp16_fixed": "fp16 autocast, fixed loss scale 64 (never updated)",
    "bf16": "bf16 autocast, no loss scaler",
    "fp16_noscaler": "fp16 autocast, no loss scaler (plain loop)",
}
VERDICTS = _v.VERDICTS
FIXED_SCALE = 64.0


@dataclass
class Experiment:
    """What ``factory()`` returns: a model, its optimizer, the batches and the loss.

    ``batches`` is any iterable of batches (a list or DataLoader is cycled when ``steps`` needs
    more; a one-shot iterator ends the run when exhausted). ``loss_fn(model, batch)`` returns
    the scalar loss.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterable[Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(
                f"Experiment.model must be a torch.nn.Module, got {type(self.model).__name__}"
            )
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Experiment.optimizer must be a torch.optim.Optimizer, got "
                f"{type(self.optimizer).__name__}"
            )
        if not isinstance(self.batches, Iterable):
            raise TypeError(
                f"Experiment.batches must be an iterable of batches, got "
                f"{type(self.batches).__name__}"
            )
        if not callable(self.loss_fn):
            raise TypeError(
                f"Experiment.loss_fn must be callable as loss_fn(model, batch), got "
                f"{type(self.loss_fn).__name__}"
            )


@dataclass
class VariantResult:
    """One variant's run. ``trained``/``reason``, ``max_rel_dev`` and ``throughput_ratio`` are
    filled in against the fp32 baseline; ``throughput_ratio`` > 1 means faster than fp32."""

    name: str
    description: str
    losses: list[float]
    skipped: int = 0
    skipped_at: list[int] = field(default_factory=list)  # 1-based steps the Guard skipped
    final_scale: float | None = None
    seconds: float = 0.0  # wall time of the timed steps (all but the first)
    timed_steps: int = 0
    step_seconds: float = math.nan  # per step: median on CPU, mean on accelerators
    error: str | None = None
    params_finite: bool = True
    first_bad_step: int | None = None  # 1-based step of the first skip or non-finite loss
    trained: bool = False
    reason: str = ""
    max_rel_dev: float = 0.0
    throughput_ratio: float = 1.0
    gap_to_bf16: float | None = None  # fp8 variants: final loss minus bf16's
    converted: list[str] = field(default_factory=list)  # mxfp8/nvfp4: the emulated layers

    @property
    def steps(self) -> int:
        """Steps run (fewer than asked when the batches ran out or the run raised)."""
        return len(self.losses)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; non-finite numbers become None."""
        d = dataclasses.asdict(self)
        d["losses"] = [_v.json_float(x) for x in self.losses]
        for key in ("max_rel_dev", "throughput_ratio", "final_scale", "seconds", "step_seconds"):
            d[key] = None if d[key] is None else _v.json_float(d[key])
        d["steps"] = self.steps
        return d


@dataclass
class Comparison:
    """The result of :func:`compare`: per-variant results and the verdict.

    ``failing_batch`` is the 0-based index (in the batch stream) of the first batch on which
    fp16 with the fixed scale failed, for the ``fp16_range`` verdict; ``diagnosis`` is what
    ``ampguard.locate`` said about it (None when forensics is unavailable; see ``locate_error``).
    """

    variants: dict[str, VariantResult]
    verdict: str
    explanation: str
    fix: str
    steps: int
    failing_batch: int | None = None
    diagnosis: Any = None
    locate_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def finding(self) -> Finding:
        """The verdict as a :class:`~ampguard.findings.Finding` (AG333-AG336)."""
        evidence: dict[str, Any] = {
            n: {"trained": r.trained, "skipped": r.skipped, "reason": r.reason}
            for n, r in self.variants.items()
        }
        if self.failing_batch is not None:
            evidence["failing_batch"] = self.failing_batch
        return make(_v.CODES[self.verdict], self.explanation, evidence=evidence, fix=self.fix)

    def summary(self) -> str:
        """A plain-text table of the variants followed by the verdict."""
        return _v.summary(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of everything (the diagnosis as its ``explain()`` text)."""
        return {
            "verdict": self.verdict,
            "explanation": self.explanation,
            "fix": self.fix,
            "steps": self.steps,
            "failing_batch": self.failing_batch,
            "diagnosis": _v.explain(self.diagnosis),
            "locate_error": self.locate_error,
            "finding": self.finding().to_dict(),
            "variants": {n: r.to_dict() for n, r in self.variants.items()},
            "fp8": self.extra.get("fp8"),  # fp8 variants: verdict, layers kept in bf16, plan
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``comparison.json`` and a self-contained ``comparison.html`` (plots embedded as
        base64 PNG) into ``directory``; return the HTML path."""
        from ampguard.experiments._html import write_report

        return write_report(self, Path(directory))


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
    fp8 = any(n in _f8.FP8_VARIANTS or n in _lp.LOWP_VARIANTS for n in names)
    bar = _progress(progress, steps * (len(names) + fp8))
    results: dict[str, VariantResult] = {}
    capture: dict[str, Any] = {}
    plan = _fp8_plan(factory, seed, names)
    bf16_again = None
    try:
        for name in names:
            if bar is not None:
                bar.set_description(name)
            results[name] = _run_variant(factory, name, steps, seed, scaler, bar, capture, plan)
        if fp8:  # bf16's run-to-run noise, the yardstick of the fp8 verdict
            if bar is not None:
                bar.set_description("bf16 (seed + 1)")
            bf16_again = _run_variant(factory, "bf16", steps, seed + 1, scaler, bar, {}, None)
    finally:
        if bar is not None:
            bar.close()
    cmp = Comparison(results, *_v.judge(results, steps), steps)
    _f8.judge_fp8(cmp, plan, bf16_again)
    _lp.judge_lowp(cmp, bf16_again)
    if cmp.verdict == "fp16_range" and "batch" in capture:
        cmp.failing_batch = capture["index"]
        cmp.explanation += (
            f" First failing batch: #{cmp.failing_batch} (step "
            f"{cmp.failing_batch + 1} of the fixed-scale run)."
        )
        _locate(cmp, factory, seed, capture)
    if cmp.verdict == "silent_stall":  # the per-layer evidence of the stalled variant
        picked = _stall.pick(results, _v.TAIL_RTOL, _v.MAX_SKIP_FRACTION)
        if picked is not None and picked[0] in capture.get("last", {}):
            from ampguard.forensics import locate

            _stall.evidence(
                cmp, picked[0], lambda: _fresh(factory, seed), capture["last"][picked[0]], locate
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
    known = (*VARIANTS, *_f8.FP8_VARIANTS, *_lp.LOWP_VARIANTS)
    if isinstance(variants, str) or not all(isinstance(v, str) for v in variants):
        raise TypeError(f"variants must be a sequence of variant names from {known}")
    unknown = [v for v in variants if v not in known]
    if unknown:
        raise ValueError(f"variants must be names from {known}, got unknown {unknown}")
    fp8 = any(v in _f8.FP8_VARIANTS or v in _lp.LOWP_VARIANTS for v in variants)  # bf16: ref
    chosen = [n for n in known if n == "fp32" or n in variants or (fp8 and n == "bf16")]
    if len(chosen) < 2:
        raise ValueError("variants must name at least one variant besides the fp32 baseline")
    return chosen


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="step", leave=False)


def seed_all(seed: int) -> None:
    """Seed Python's, torch's and numpy's RNGs (what compare does before each variant)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is optional for seeding purposes
        pass


def _fresh(factory: Callable[[], Experiment], seed: int) -> Experiment:
    seed_all(seed)
    exp = factory()
    if not isinstance(exp, Experiment):
        raise TypeError(f"factory() must return an ampguard.Experiment, got {type(exp).__name__}")
    return exp


def _stream(batches: Iterable[Any], steps: int) -> Iterator[Any]:
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


def _fp8_plan(factory: Callable[[], Experiment], seed: int, names: list[str]) -> Any:
    """The fp8 plan on the first batch of a fresh experiment when an fp8 variant runs."""
    from ampguard.fp8._torchao import require_torchao

    if any(n in _lp.LOWP_VARIANTS for n in names):
        require_torchao()  # missing torchao: one clear error before any variant runs
    if not any(n in _f8.FP8_VARIANTS for n in names):
        return None
    require_torchao()
    exp = _fresh(factory, seed)
    first = next(_stream(exp.batches, 1), None)
    return None if first is None else _f8.make_plan(exp, first)


def _make_guard(name: str, exp: Experiment, scaler: ScalerConfig | None, plan: Any = None) -> Any:
    from ampguard.guard import Guard

    if name in _f8.FP8_VARIANTS:
        return Guard(
            exp.model,
            exp.optimizer,
            precision="fp8",
            fp8_plan=plan if name == "fp8_planned" else None,
        )
    if name in _lp.LOWP_VARIANTS:  # the layers are emulated in the format (see _run_variant)
        return Guard(exp.model, exp.optimizer, precision="bf16", skip_nonfinite=False)
    if name in ("fp32", "bf16"):  # what the precision itself does: non-finite steps applied
        return Guard(exp.model, exp.optimizer, precision=name, skip_nonfinite=False)
    cfg = scaler or ScalerConfig()
    if name == "fp16_fixed":
        cfg = ScalerConfig(init_scale=FIXED_SCALE, dynamic=False)
    # Collapses become skipped steps, so every variant yields a full loss curve.
    cfg = dataclasses.replace(cfg, on_collapse="warn")
    return Guard(exp.model, exp.optimizer, precision="fp16", scaler=cfg)


def _run_variant(
    factory: Callable[[], Experiment],
    name: str,
    steps: int,
    seed: int,
    scaler: ScalerConfig | None,
    bar: Any,
    capture: dict[str, Any],
    plan: Any = None,
) -> VariantResult:
    exp = _fresh(factory, seed)
    res = VariantResult(name, {**VARIANTS, **_f8.FP8_VARIANTS, **_lp.LOWP_VARIANTS}[name], [])
    if name in _lp.LOWP_VARIANTS:
        res.converted = _lp.prepare(name, exp.model)
    guard = None if name == "fp16_noscaler" else _make_guard(name, exp, scaler, plan)
    device_type = next(p.device.type for p in exp.model.parameters())
    losses: list[torch.Tensor] = []
    last = None
    clock = StepClock(device_type)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for i, batch in enumerate(_stream(exp.batches, steps)):
                last = batch
                losses.append(_step(exp, guard, batch, device_type, res, i, capture))
                clock.tick()
                if bar is not None:
                    bar.update(1)
    except Exception as exc:  # noqa: BLE001 - an AMP variant failing is a result, not a crash
        if name == "fp32":
            raise
        res.error = f"{type(exc).__name__}: {exc}"
    res.seconds, res.timed_steps, res.step_seconds = clock.stop()
    res.losses = torch.stack(losses).tolist() if losses else []
    res.params_finite = all(bool(torch.isfinite(p).all()) for p in exp.model.parameters())
    if guard is not None and name.startswith("fp16"):
        res.final_scale = guard.scale
    if name in _stall.STALL_ORDER and last is not None and res.error is None:
        # a silent stall is judged later: keep what locate needs to name its layer
        _stall.capture(capture.setdefault("last", {}), name, exp, last, res.final_scale or 1.0)
    bad = [i + 1 for i, x in enumerate(res.losses) if not _v.finite(x)]
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
    with torch.autocast(device_type, dtype=torch.float16):
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


def _locate(
    cmp: Comparison, factory: Callable[[], Experiment], seed: int, capture: dict[str, Any]
) -> None:
    """Run ``ampguard.locate`` on the first failing batch, if forensics is installed."""
    try:
        locate = importlib.import_module("ampguard.forensics").locate
    except (ImportError, AttributeError) as exc:
        cmp.locate_error = f"ampguard.forensics.locate is unavailable ({exc})"
        return
    exp = _fresh(factory, seed)
    exp.model.load_state_dict(capture["state"])
    kwargs: dict[str, Any] = {"precision": "fp16"}
    if "scale" in inspect.signature(locate).parameters:
        kwargs["scale"] = FIXED_SCALE
    try:
        cmp.diagnosis = locate(exp.model, exp.loss_fn, capture["batch"], **kwargs)
    except Exception as exc:  # noqa: BLE001 - the comparison stands without a diagnosis
        cmp.locate_error = f"locate failed: {type(exc).__name__}: {exc}"
        return
    _v.add_diagnosis(cmp)
