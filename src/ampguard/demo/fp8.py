"""``ampguard demo --precision fp8``: plan, then train a transformer-like model in fp8.

The model (:mod:`ampguard.demo.fp8_model`) carries one planted outlier-feature layer,
``head``. The demo prints the fp8 plan (that layer is kept in bf16, the others go to
fp8), trains through ``Guard(precision="fp8", fp8_plan=plan)`` with telemetry, checkpoints, and
ends with the report. On a machine without fp8 matmuls torchao emulates them (said once).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ampguard._util.checks import check_int
from ampguard.checkpoint import save_checkpoint
from ampguard.demo.fp8_model import OUTLIER_LAYER, OutlierNet, OutlierTask, loss_fn, make_task
from ampguard.fp8 import Fp8Plan, fp8_plan, require_torchao
from ampguard.guard import Guard
from ampguard.reporting import report
from ampguard.telemetry import Telemetry

__all__ = ["run_fp8_demo", "Fp8DemoResult"]


@dataclass
class Fp8DemoResult:
    """What the fp8 demo did: the plan, the layers in fp8, the losses and the files."""

    steps: int
    plan: Fp8Plan
    converted: list[str]
    kept: list[str]
    emulated: bool
    loss_before: float
    loss_after: float
    seconds: float
    run_dir: Path
    checkpoint: Path
    report: Path | None = None
    findings: list[str] = field(default_factory=list)


def run_fp8_demo(
    steps: int = 300,
    seed: int = 0,
    out: str | Path = "ampguard-runs/demo-fp8",
    progress: bool = True,
    quiet: bool = False,
) -> Fp8DemoResult:
    """Plan, train in fp8, checkpoint, report; print a summary ending with the report path."""
    check_int("steps", steps)
    require_torchao()  # before anything is printed or written
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    task = make_task(seed=seed, steps=steps)
    torch.manual_seed(seed)
    model = OutlierNet()
    plan = fp8_plan(model, loss_fn, next(task.batches()))
    if not quiet:
        print(plan.summary() + "\n")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    with warnings.catch_warnings():  # the summary says whether fp8 is emulated
        warnings.simplefilter("ignore", RuntimeWarning)
        guard = Guard(
            model,
            optimizer,
            precision="fp8",
            fp8_plan=plan,
            clip_grad_norm=1.0,
            schedulers=[schedule],
            telemetry=Telemetry(run_dir, range_every=max(1, steps // 10)),
        )
    loss_before = _eval(guard, model, task)
    started = time.perf_counter()
    _train(guard, model, task, progress)
    seconds = time.perf_counter() - started
    checkpoint = save_checkpoint(
        run_dir / "checkpoint.pt",
        model=model,
        optimizer=optimizer,
        guard=guard,
        scheduler=schedule,
        extra={"seed": seed},
    )
    found = guard.findings()
    guard.close()
    assert guard.fp8 is not None  # precision="fp8": the Guard holds its conversion
    result = Fp8DemoResult(
        steps=steps,
        plan=plan,
        converted=list(guard.fp8.layers),
        kept=list(guard.fp8.kept),
        emulated=guard.fp8.emulated,
        loss_before=loss_before,
        loss_after=_eval(guard, model, task),
        seconds=seconds,
        run_dir=run_dir,
        checkpoint=checkpoint,
        findings=[f"{f.code} {f.title}" + (f" (step {f.step})" if f.step else "") for f in found],
    )
    result.report = report(run_dir)
    if not quiet:
        print(summary(result))
    return result


def _train(guard: Guard, model: torch.nn.Module, task: OutlierTask, progress: bool) -> None:
    from tqdm import tqdm

    for batch in tqdm(
        task.batches(),
        total=task.steps,
        disable=not progress,
        desc="fp8 training",
        unit="step",
        leave=False,
    ):
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        guard.step()


def _eval(guard: Guard, model: torch.nn.Module, task: OutlierTask) -> float:
    with torch.no_grad(), guard.autocast():
        return float(loss_fn(model, (task.eval_x, task.eval_y)))


def summary(r: Fp8DemoResult) -> str:
    """The text the demo prints after training."""
    where = (
        "emulated on this device (real fp8 casts, matmul in high precision)"
        if r.emulated
        else "fp8 matmuls"
    )
    kept = ", ".join(r.kept) or "none"
    lines = [
        f"ampguard demo: {r.steps} steps in fp8 ({r.plan.float8_recipe}, {where}; "
        f"{r.seconds:.1f} s)",
        f"  planted outlier-feature layer: {OUTLIER_LAYER} "
        f"({'kept in bf16' if OUTLIER_LAYER in r.kept else 'IN FP8'})",
        f"  in fp8:            {', '.join(r.converted) or 'none'}",
        f"  kept in bf16:      {kept}",
        f"  eval loss:         {r.loss_before:.4f} -> {r.loss_after:.4f}",
    ]
    lines += [f"  finding:           {f}" for f in r.findings]
    lines += [
        f"  report fp8 section: {line}" if i == 0 else f"    {line}"
        for i, line in enumerate(_report_lines(r.run_dir))
    ]
    lines += [f"  run folder:        {r.run_dir}", f"  checkpoint:        {r.checkpoint}"]
    if r.report is not None:
        lines.append(f"  report:            {r.report}")
    return "\n".join(lines)


def _report_lines(run_dir: Path) -> list[str]:
    from ampguard.reporting import fp8_text_lines as text_lines
    from ampguard.runlog import load_run

    return text_lines(load_run(run_dir))
