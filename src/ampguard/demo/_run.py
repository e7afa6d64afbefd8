"""The demo's run: the model, the training loop with its Guard, the report and the summary."""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ampguard import precisions
from ampguard._util.checks import check_int
from ampguard.checkpoint import save_checkpoint
from ampguard.core.scaler import ScalerConfig
from ampguard.demo.data import DemoData, make_data
from ampguard.guard import Guard
from ampguard.reporting import report

__all__ = ["run_demo", "DemoResult", "build_model"]


@dataclass
class DemoResult:
    """What the demo did: counts, scales, losses and the files it wrote."""

    steps: int
    precision: str
    skipped: list[int]
    spike_steps: tuple[int, ...]
    scale_start: float
    scale_end: float
    scale_min: float
    loss_before: float
    loss_after: float
    seconds: float
    run_dir: Path
    checkpoint: Path
    report: Path | None = None
    diagnostics: dict = field(default_factory=dict)
    extra_lines: list[str] = field(default_factory=list)


def build_model(data: DemoData, seed: int) -> torch.nn.Sequential:
    """The student: a 3-layer GELU MLP with named layers (findings name them), seeded."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        OrderedDict(
            encoder=torch.nn.Linear(data.in_dim, 64),
            act1=torch.nn.GELU(),
            hidden=torch.nn.Linear(64, 64),
            act2=torch.nn.GELU(),
            head=torch.nn.Linear(64, data.out_dim),
        )
    )


def run_demo(
    steps: int = 300,
    seed: int = 0,
    out: str | Path = "ampguard-runs/demo",
    precision: str = "fp16",
    progress: bool = True,
    quiet: bool = False,
) -> DemoResult:
    """Train, checkpoint, report; print a summary ending with the report path; return it."""
    check_int("steps", steps)
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = make_data(seed=seed, steps=steps)
    model = build_model(data, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    guard = Guard(
        model,
        optimizer,
        precision=precision,
        clip_grad_norm=1.0,
        scaler=ScalerConfig(growth_interval=50),
        schedulers=[schedule],
        telemetry=run_dir,
        forensics=True,
    )
    loss_before = _eval_loss(model, data)
    scale_start = guard.scale
    started = time.perf_counter()
    with warnings.catch_warnings():  # the summary lists the spikes (AG180 findings)
        warnings.filterwarnings("ignore", "loss spike at step", RuntimeWarning)
        skipped, scales = _train(guard, model, data, progress)
    seconds = time.perf_counter() - started
    checkpoint = save_checkpoint(
        run_dir / "checkpoint.pt",
        model=model,
        optimizer=optimizer,
        guard=guard,
        scheduler=schedule,
        extra={"seed": seed},
    )
    diagnostics = guard.diagnostics()
    findings = guard.findings()
    guard.close()
    result = DemoResult(
        steps=steps,
        precision=guard.precision,
        skipped=skipped,
        spike_steps=data.spike_steps,
        scale_start=scale_start,
        scale_end=guard.scale,
        scale_min=min(scales, default=1.0),
        loss_before=loss_before,
        loss_after=_eval_loss(model, data),
        seconds=seconds,
        run_dir=run_dir,
        checkpoint=checkpoint,
        diagnostics=diagnostics,
        extra_lines=[
            f"  finding:           {f.code} [{f.severity}] {f.title}"
            + (f" (step {f.step})" if f.step else "")
            + ("; transient: skipping absorbed it" if f.evidence.get("transient") else "")
            for f in findings
        ],
    )
    result.report = report(run_dir)
    if not quiet:
        print(summary(result))
    return result


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _train(
    guard: Guard, model: torch.nn.Module, data: DemoData, progress: bool
) -> tuple[list[int], list[float]]:
    from tqdm import tqdm

    skipped: list[int] = []
    scales: list[float] = []
    bar = tqdm(
        data.batches(),
        total=data.steps,
        disable=not progress,
        desc="fp16 training",
        unit="step",
        leave=False,
    )
    for step, batch in enumerate(bar, start=1):
        with guard.autocast():
            loss = _loss(model, batch)
        guard.backward(loss)
        # batch + loss_fn let forensics replay an overflowing step in fp16 and fp32 (only then)
        if not guard.step(batch=batch, loss_fn=_loss).applied:  # the sync torch's scaler has too
            skipped.append(step)
            scales.append(guard.scale)
    return skipped, scales


def _eval_loss(model: torch.nn.Module, data: DemoData) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(data.eval_x), data.eval_y))


def summary(r: DemoResult) -> str:
    """The text the demo prints: counts, causes, scale, loss, then where the outputs are."""
    lines = [
        f"ampguard demo: {r.steps} steps in {r.precision} on cpu ({r.seconds:.1f} s)",
        f"  eval loss (fp32):  {r.loss_before:.4f} -> {r.loss_after:.4f}",
        f"  skipped steps:     {len(r.skipped)} of {r.steps}",
    ]
    scaled = precisions.REGISTRY[r.precision].needs_scaler
    for first, last in _runs(r.skipped):
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        if not scaled:
            where = "outlier batch (inputs x4096): " if first in r.spike_steps else ""
            lines.append(f"    {span}: {where}non-finite gradients in {r.precision}; step skipped")
            continue
        cause = (
            f"outlier batch (inputs x4096): non-finite gradients in {r.precision}"
            if first in r.spike_steps
            else "gradients overflowed at the current loss scale"
        )
        lines.append(f"    {span}: {cause}; step skipped, scale backed off")
    if scaled:
        lines.append(
            f"  loss scale:        {r.scale_start:g} -> {r.scale_end:g} "
            f"(lowest after a skip: {r.scale_min:g})"
        )
    else:
        lines.append(f"  loss scale:        none ({r.precision} needs no loss scale)")
    d = r.diagnostics
    if d and not scaled:
        lines.append(
            f"  diagnostics:       {d['consecutive_skips']} consecutive skips now, "
            f"{d['microbatches_dropped']} micro-batches dropped"
        )
    elif d:
        recent = ", ".join(f"{e['step']}: {e['scale']:g}" for e in d["last_scales"][-4:])
        fallbacks = (
            "; ".join(f"{f['from']} -> {f['to']} at step {f['step']}" for f in d["fallbacks"])
            or "none"
        )
        lines.append(
            f"  diagnostics:       {d['scale_changes']} scale changes, "
            f"{d['consecutive_skips']} consecutive skips now, "
            f"{d['microbatches_dropped']} micro-batches dropped, fallbacks: {fallbacks}"
        )
        lines.append(f"                     last scales (step: scale): {recent}")
    lines.extend(r.extra_lines)
    lines.append(f"  run folder:        {r.run_dir}")
    lines.append(f"  checkpoint:        {r.checkpoint}")
    if r.report is not None:
        lines.append(f"  report:            {r.report}")
    return "\n".join(lines)


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs
