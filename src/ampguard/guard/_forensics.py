"""The Guard's forensics and precision fixes: ``keep_fp32``, ``forensics``, ``auto_fallback``,
``coverage_step``.

- ``keep_fp32=[patterns]`` puts the matching modules (name globs, or module classes such as
  ``torch.nn.BatchNorm2d``) in fp32 islands when the Guard is built; the state keeps the names.
- ``forensics=True`` arms op-level tracing (:mod:`ampguard.forensics._optrace`) for the next
  :data:`ARM_STEPS` windows after an overflow that is not the scaler's start-up descent (the
  first overflow before any applied step). An armed window that overflows is diagnosed from its
  own trace: the first op that made a non-finite value, its module and pass, and that op rerun
  from fp32 copies of its inputs, which tells a real fp16 overflow (still beyond 65504 at the
  scaler's ``min_scale``) from the scaler probing its level (benign: no finding). When
  ``guard.step(batch=..., loss_fn=...)`` hands over the batch, an overflowing step is replayed
  with :func:`locate` instead (fp16 vs fp32, three runs). Unarmed windows cost nothing.
- ``auto_fallback=True`` (implies ``forensics``) keeps a module diagnosed ``fp16_overflow`` in
  fp32 from the next step on and records the change (AG306); the next module that overflows on
  that fp32 value is diagnosed and kept in fp32 as well. It also scans the forward of one clean
  window every ``range_every`` windows (:mod:`ampguard.forensics._absorbed_scan`): a confirmed
  absorbed overflow (``fp16_overflow_absorbed``, AG360) sends its module to fp32 the same way.
- ``coverage_step=N`` traces window N and keeps its :class:`~ampguard.Coverage`.

With telemetry the diagnoses and changes go to ``forensics.json``, the coverage to
``coverage.json`` in the run folder, and their findings into ``findings.json``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from ampguard import runlog
from ampguard._util.cadence import early_or_every
from ampguard.core.policy import PrecisionPolicy
from ampguard.core.results import StepResult
from ampguard.core.scaler import ScalerConfig
from ampguard.findings import Finding
from ampguard.forensics import (
    Diagnosis,
    OpTrace,
    diagnose_absorbed,
    diagnose_trace,
    fallback_finding,
    locate,
    reproduced,
    scan_every,
    soften,
)
from ampguard.forensics import check_arguments as check
from ampguard.forensics.autocast_coverage import Coverage, coverage_from_events
from ampguard.forensics.islands import Fp32Islands, Pattern, keep_fp32
from ampguard.replay import rng_state
from ampguard.telemetry import Telemetry

__all__ = ["ARM_STEPS", "ForensicsHost", "GuardForensics", "attach"]

ARM_STEPS = 3
FORENSICS_FILE = "forensics.json"
COVERAGE_FILE = runlog.COVERAGE


class ForensicsHost(Protocol):
    """What the Guard's forensics reads from the Guard: its public surface (no sync)."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def precision(self) -> str: ...

    @property
    def policy(self) -> PrecisionPolicy: ...

    @property
    def steps(self) -> int: ...

    @property
    def scaler_config(self) -> ScalerConfig: ...

    @property
    def telemetry(self) -> Telemetry | None: ...

    def scale_used_at(self, step: int) -> float: ...


def attach(
    guard: ForensicsHost,
    *,
    keep_fp32: Any = None,
    forensics: Any = False,
    auto_fallback: Any = False,
    coverage_step: Any = None,
) -> GuardForensics | None:
    """Validate the Guard arguments; None when none of them is in use (zero cost)."""
    check(guard.model, keep_fp32, forensics, auto_fallback, coverage_step)
    if not (keep_fp32 or forensics or auto_fallback or coverage_step):
        return None
    return GuardForensics(
        guard, keep_fp32, forensics or auto_fallback, auto_fallback, coverage_step
    )


class GuardForensics:
    """State and hooks behind the Guard's forensics arguments (see the module docstring)."""

    def __init__(
        self,
        guard: ForensicsHost,
        patterns: Iterable[Pattern] | Pattern | None,
        enabled: bool,
        auto_fallback: bool,
        coverage_step: int | None,
    ) -> None:
        self.guard = guard
        self.islands = keep_fp32(guard.model, patterns) if patterns else Fp32Islands(guard.model)
        self.enabled = enabled
        self.auto_fallback = auto_fallback
        self.coverage_step = coverage_step
        self.coverage: Coverage | None = None
        self.diagnoses: list[tuple[int, Diagnosis, str]] = []  # (step, diagnosis, via)
        self.changes: list[dict[str, Any]] = []
        self.benign = 0
        self._armed = 0
        self._overflows_in_a_row = 0
        self._seen_applied = False
        self._trace: OpTrace | None = None
        self._scan_only = False  # the trace is an absorbed-overflow scan, not an armed window
        self._losses: list[torch.Tensor] = []
        self._rng: dict[str, Any] | None = None  # RNG as the latest forward started (replays)

    # ------------------------------------------------------------------ Guard hooks
    def arm(self, steps: int = ARM_STEPS) -> None:
        """Trace the next ``steps`` windows op by op, as after an overflow (benchmarks use it to
        measure armed forensics). No host sync."""
        self._armed = max(self._armed, steps)

    def check_replay(self, batch: Any, loss_fn: Any) -> None:
        """``Guard.step(batch=, loss_fn=)``: both or neither, and a callable loss_fn."""
        if (batch is None) != (loss_fn is None) or (loss_fn is not None and not callable(loss_fn)):
            raise ValueError(
                "Guard.step(batch=..., loss_fn=...) replays an overflowing batch "
                "with ampguard.locate: pass both, loss_fn(model, batch) -> loss"
            )

    def session(self, phase: str) -> contextlib.AbstractContextManager:
        """Trace this pass when the window is armed or is the coverage step; else a no-op.

        With ``forensics``, each forward also keeps the global RNG state it starts from (CPU,
        and the accelerator's), so a replay of the batch handed to ``step()`` (the window's last
        micro-batch) draws the same dropout masks as the step that failed. Cost: a host copy of
        the generator states per forward, no device sync."""
        if phase == "forward" and self.enabled:
            self._rng = rng_state(self.guard.device.type)
        if phase == "forward" and self._trace is None and (self._wanted() or self._scan_due()):
            self._scan_only = not self._wanted()
            self._trace = OpTrace(self.guard.model, numerics=self._armed > 0 or self._scan_only)
        if self._trace is None or (phase == "backward" and self._scan_only):
            return contextlib.nullcontext()
        return self._trace.session(phase)

    def on_loss(self, loss: torch.Tensor) -> None:
        if self._trace is not None and self._trace.numerics:
            self._losses.append(torch.isfinite(loss.detach()).all())

    def on_settled(self, step: int, overflow: bool, applied: bool) -> None:
        """Every window's flags, in order, once on the host (no extra sync): arm on overflow."""
        if applied:
            self._seen_applied, self._overflows_in_a_row = True, 0
        elif overflow:
            self._overflows_in_a_row += 1
            if self.enabled and (self._seen_applied or self._overflows_in_a_row > 1):
                self._armed = max(self._armed, ARM_STEPS)

    def on_step(
        self,
        result: StepResult,
        batch: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        """End of a window: coverage, diagnosis of an armed or replayable overflow, fallback."""
        if not result.boundary:
            return
        trace, self._trace = self._trace, None
        losses, self._losses = self._losses, []
        scan_only, self._scan_only = self._scan_only, False
        if trace is not None and result.step == self.coverage_step:
            self._record_coverage(trace, result.step)
        if trace is not None and scan_only:
            if result.applied:  # a skipped window's overflow is not absorbed
                found = diagnose_absorbed(trace, self.guard.precision, self._scale_used())
                if found is not None:
                    self._handle(result.step, found, "scan")
                return
            trace = None  # a scanned window that skipped: diagnosed by the replay below
        armed = trace is not None and trace.numerics
        if not (armed or (batch is not None and loss_fn is not None and self.enabled)):
            return
        if not (result.overflow or result.nonfinite):  # a sync only for fused optimizers
            self._armed = max(0, self._armed - 1)
            return
        scale = self._scale_used()
        if batch is not None and loss_fn is not None:
            if not self._warming_up():
                diag = locate(
                    self.guard.model,
                    loss_fn,
                    batch,
                    self.guard.precision,
                    scale,
                    rng_state=self._rng,
                )
                self._handle(result.step, reproduced(diag, result.loss_nonfinite), "replay")
        elif armed and trace is not None:  # armed implies a trace; said for the checker
            floor = self.guard.scaler_config.min_scale
            self._handle(
                result.step,
                diagnose_trace(trace, losses, scale, self.guard.precision, floor),
                "trace",
            )

    # ------------------------------------------------------------------ internals
    def _wanted(self) -> bool:
        return self._armed > 0 or (
            self.coverage_step is not None and self.guard.steps + 1 == self.coverage_step
        )

    def _scan_due(self) -> bool:
        """auto_fallback scans the forward of windows 1, 2, 4, ... and then of every
        scan_every-th window for absorbed fp16 overflow (see ampguard.forensics._absorbed_scan)."""
        return (
            self.auto_fallback
            and self.guard.policy.entry.low_dtype == "float16"  # fp16's range can overflow
            and early_or_every(self.guard.steps + 1, scan_every(self.guard))  # 1, 2, 4 .. 100
        )

    def _warming_up(self) -> bool:
        return not self._seen_applied and self._overflows_in_a_row <= 1

    def _scale_used(self) -> float:
        return self.guard.scale_used_at(self.guard.steps)

    def _handle(self, step: int, diag: Diagnosis, via: str) -> None:
        if diag.ok and diag.stats.get("replay_reproduced") is not False:
            self.benign += diag.benign
            self._armed = 0  # the scaler was probing: nothing to catch
            return
        self.diagnoses.append((step, diag, via))
        self._armed = ARM_STEPS  # a recurring overflow is caught again
        if self.auto_fallback and _cascades(diag, self.changes):
            return  # said in the diagnosis (stats["fallback_stopped"]); no more fp32 modules
        if (
            self.auto_fallback
            and diag.kind in ("fp16_overflow", "fp16_overflow_absorbed")
            and diag.module is not None
            and self.islands.add(diag.module)
        ):
            self.changes.append(
                {
                    "step": step,
                    "module": diag.module,
                    "phase": diag.phase,
                    "op": diag.op,
                    "reason": "auto_fallback",
                    "absorbed": diag.kind == "fp16_overflow_absorbed",
                }
            )
        self._write()

    def _record_coverage(self, trace: OpTrace, step: int) -> None:
        self.coverage = coverage_from_events(
            trace.events,
            self.guard.precision,
            trace.autocast_on_entry,
            kept=self.islands.modules,
            step=step,
        )
        self._write()

    # ------------------------------------------------------------------ outputs
    def findings(self) -> list[Finding]:
        """Diagnoses (one per code/module/pass/op, with occurrences), fallbacks, coverage.

        An AG301 seen on a few close steps that did not recur over a quiet stretch after them
        is a warning that says so (:mod:`ampguard.forensics._transient`), not an error."""
        seen: dict[tuple, list[int]] = {}
        first: dict[tuple, tuple[Diagnosis, str]] = {}
        for step, d, via in self.diagnoses:
            key = (d.code, d.module, d.phase, d.op)
            seen.setdefault(key, []).append(step)
            first.setdefault(key, (d, via))
        out = []
        last = max((step for step, _, _ in self.diagnoses), default=0)
        for key, (d, via) in first.items():
            f = d.to_finding(step=seen[key][0])
            # a burst that came and went (skipping absorbed it): a warning, not an error
            f = soften(f, seen[key], last, self.guard.steps)
            out.append(
                Finding(
                    f.code,
                    f.severity,
                    f.title,
                    f.message,
                    f.step,
                    {
                        **f.evidence,
                        "via": via,
                        "steps": seen[key][:20],
                        "occurrences": len(seen[key]),
                    },
                    f.fix,
                )
            )
        out += [fallback_finding(c) for c in self.changes]
        if self.coverage is not None:
            out += self.coverage.findings()
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record of diagnoses, fallbacks and coverage."""
        return {
            "diagnoses": [{"step": s, "via": via, **d.to_dict()} for s, d, via in self.diagnoses],
            "keep_fp32": list(self.islands.modules),
            "changes": list(self.changes),
            "benign_probes": self.benign,
            "coverage_step": self.coverage_step,
        }

    def state(self) -> dict[str, Any]:
        """What a resume needs: the modules in fp32 and the fallbacks that put them there."""
        return {"keep_fp32": list(self.islands.modules), "changes": list(self.changes)}

    def load(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        for name in state.get("keep_fp32", []):
            self.islands.add(name)
        self.changes = [dict(c) for c in state.get("changes", [])]

    def _write(self) -> None:
        telemetry = self.guard.telemetry
        if telemetry is None:
            return
        telemetry.run_dir.mkdir(parents=True, exist_ok=True)
        runlog.write_json_atomic(telemetry.run_dir / FORENSICS_FILE, self.to_dict())
        if self.coverage is not None:
            runlog.write_json_atomic(telemetry.run_dir / COVERAGE_FILE, self.coverage.to_dict())


def _cascades(diag: Diagnosis, changes: list[dict[str, Any]]) -> bool:
    """A backward overflow after a backward fallback already ran: keeping that module in fp32
    only moved the cast-down of the same large gradient upstream, so more fallbacks would
    send every matmul module to fp32 one by one. Stop at the cause: the gradient flowing in
    (the loss's scale, or the layer after the first fallback). Marks ``diag.stats``."""
    if diag.phase != "backward" or diag.kind != "fp16_overflow" or diag.module is None:
        return False
    first = next(
        (c for c in changes if c.get("reason") == "auto_fallback" and c.get("phase") == "backward"),
        None,
    )
    if first is None or first["module"] == diag.module:
        return False
    diag.stats["fallback_stopped"] = {
        "first_fallback": first["module"],
        "step": first["step"],
        "reason": "the backward overflow moved upstream after the first fallback: the large "
        "gradient comes from the loss or a later layer, not from this module; reduce the loss's "
        "scale (or the loss scale), or keep the loss's last layers in fp32",
    }
    return True
