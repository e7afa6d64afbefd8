"""What :func:`ampguard.compare` takes and gives: an :class:`Experiment`, its results.

:class:`Experiment` is what the user's factory returns; :class:`VariantResult` is one variant's
run and :class:`Comparison` the whole comparison with its verdict (judged in
:mod:`ampguard.experiments._verdict`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampguard.experiments import _verdict
from ampguard.findings import Finding, make

__all__ = ["Comparison", "Experiment", "VERDICTS", "VariantResult"]

VERDICTS = _verdict.VERDICTS


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
        d["losses"] = [_verdict.json_float(x) for x in self.losses]
        for key in ("max_rel_dev", "throughput_ratio", "final_scale", "seconds", "step_seconds"):
            d[key] = None if d[key] is None else _verdict.json_float(d[key])
        d["steps"] = self.steps
        return d


@dataclass
class Comparison:
    """The result of :func:`compare`: per-variant results and the _verdict.

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
        return make(_verdict.CODES[self.verdict], self.explanation, evidence=evidence, fix=self.fix)

    def summary(self) -> str:
        """A plain-text table of the variants followed by the _verdict."""
        return _verdict.summary(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of everything (the diagnosis as its ``explain()`` text)."""
        return {
            "verdict": self.verdict,
            "explanation": self.explanation,
            "fix": self.fix,
            "steps": self.steps,
            "failing_batch": self.failing_batch,
            "diagnosis": _verdict.explain(self.diagnosis),
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


Experiment.__module__ = "ampguard.experiments"  # its public home: repr and pickles name that path
Comparison.__module__ = "ampguard.experiments"  # its public home: repr and pickles name that path
