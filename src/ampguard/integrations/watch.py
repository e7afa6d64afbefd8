"""Attach mode: ``ag.watch`` observes a training loop that keeps its own loss scaler.

>>> scaler = torch.amp.GradScaler("cuda")
>>> with ag.watch(scaler, model, optimizer, telemetry="runs/exp1") as handle:
...     for x, y in data:
...         with torch.autocast("cuda", dtype=torch.float16):
...             loss = loss_fn(model(x), y)
...         scaler.scale(loss).backward()
...         scaler.step(optimizer)
...         scaler.update()
...         optimizer.zero_grad()
>>> handle.findings()             # AG1xx findings over the run; runs/exp1 holds the run log

The loop is unchanged and so are its numbers: parameters, optimizer state and the scale are
bitwise identical to the same loop without ``watch`` (the scaler's methods are wrapped, read and
called through; gradients are read, never written). Skipped steps come from the ``found_inf``
tensors the scaler itself used, so fused optimizers (whose ``step`` runs even on a skipped step)
are reported right. Recording goes through :class:`ampguard.Telemetry` (device ring buffer,
deferred flush), so between flushes ``watch`` adds no host sync.

Optional attach-mode guard features (``min_scale``, ``max_scale``, ``hysteresis``) are applied
through the scaler's ``update``; they change numbers only in the pathological regime (a scale
falling below the floor, growing past the cap, or halving on a lone spike). See
:mod:`ampguard.integrations._policy`.

The Watch talks to its scaler only through the seam (:mod:`ampguard.integrations._seam`): the
scale, the step's outcome, the moment the gradients are final, and a description for the run
log. ``torch.amp.GradScaler`` is one implementation (:mod:`ampguard.integrations._tap`); an
integration with its own scaler implements the protocol in its own file.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ampguard import precisions, runlog
from ampguard import telemetry as _telemetry
from ampguard._util.stack import user_stacklevel
from ampguard.core import results
from ampguard.core.ema import as_watches
from ampguard.core.scaler import ScaleCollapseError
from ampguard.core.stagnation import StagnationProbe
from ampguard.findings import Finding
from ampguard.guard import DEFAULT_CAPACITY, attach_signatures, check_signatures
from ampguard.integrations import _findings, _seam, _skip
from ampguard.integrations._autopsy import AutopsySurface
from ampguard.integrations._backward_end import BackwardEnd, nonfinite_flag
from ampguard.integrations._optim import as_optimizer_list
from ampguard.integrations._policy import AttachPolicy, PolicyState
from ampguard.integrations._probes import UpdateProbes
from ampguard.integrations._recorder import AttachRecorder, RecorderOptions, spike_config
from ampguard.integrations._resume import ResumeSurface
from ampguard.integrations._seam import StepOutcome, WatchableScaler
from ampguard.integrations._skip import SkipSteps
from ampguard.integrations._source import (
    PRECISIONS,
    WatchSource,
    as_tensor,
    refuse_engine,
    resolve_precision,
    resolve_telemetry,
    warn_no_scaler,
)
from ampguard.integrations._triage import TriageSurface

__all__ = ["watch", "Watch", "WatchSource", "PRECISIONS"]


def watch(
    scaler: Any,
    model: torch.nn.Module,
    optimizer: Any,
    telemetry: Any,
    *,
    precision: str | None = None,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    on_collapse: str = "warn",
    ema: Any = None,
    flight_recorder: int | bool = DEFAULT_CAPACITY,
    on_spike: str | None = "warn",
    snapshot_every: int | None = None,
    signatures: bool | int = False,
) -> Watch:
    """Observe a loop that calls ``scaler.scale/step/update`` itself; return a :class:`Watch`.

    ``scaler``: the loop's ``torch.amp.GradScaler`` (or a subclass), another scaler ampguard has
    an adapter for (:data:`ampguard.integrations._seam.ADAPTERS`), an object implementing
    :class:`ampguard.integrations._seam.WatchableScaler`, or ``None`` for
    a bf16/fp32 loop without one (then give ``precision``; steps are recorded from the
    optimizer's step hooks).
    ``optimizer``: one optimizer or a list (framework wrappers are unwrapped). ``telemetry``: a run
    folder or an :class:`ampguard.Telemetry`. ``precision``: ``"fp16"`` (the default with an
    enabled scaler), ``"bf16"`` or ``"fp32"``.

    Guard features, all off by default (pure observation): ``min_scale`` (floor), ``max_scale``
    (cap), ``hysteresis`` (overflows tolerated before backing off; ``consecutive_hysteresis``
    refills the budget on every clean step, else only when the scale grows) and ``on_collapse``
    (``"warn"`` | ``"raise"`` when overflows persist at ``min_scale``; checked at each flush).

    ``ema``: EMA / teacher modules the optimizer does not own (or ``ag.watch_ema`` objects),
    updated anywhere in the loop: their lost updates are measured between the first optimizer's
    steps (AG175 naming ``ema.*`` layers; see :mod:`ampguard.core.ema`).

    The Guard's flight recorder and loss-spike detection (``docs/spikes.md``), sync-free:
    ``flight_recorder`` (windows the device ring keeps; False: none), ``on_spike``
    (``"warn"``, ``"skip"``, ``"rewind"``, ``"raise"`` or None, checked as the Guard checks
    them; a GradScaler's step or a scaler-free optimizer's step is skipped, see
    :mod:`ampguard.integrations._skip`; ``"rewind"`` skips: attach mode cannot rewind),
    ``snapshot_every`` (None: no snapshots; N: the Guard's in-memory snapshots every N steps,
    for ``ampguard.triage`` of a step before the last and the replay of
    ``ampguard.autopsy(handle)``) and ``signatures`` (the Guard's ``signatures=``, for
    ``ampguard.triage(handle)``; hand each batch to :meth:`Watch.record_batch`). A spike or
    non-finite step dumps the ring into ``RUN_DIR/flight_recorder`` (``ampguard postmortem
    RUN_DIR``). A resume keeps the detector's statistic: save ``handle.state_dict()`` with the
    checkpoint, ``handle.load_state_dict(...)`` before the resumed run's first step.

    Without a scaler the gradients are sampled when each backward pass ends (before the loop
    clips them: the recorded norm is the unscaled total norm before clipping, as with a scaler),
    and every step's gradients are checked for NaN/inf (recorded, never changed: the loop's step
    is its own; AG110 reports steps that applied non-finite gradients).

    Cost: one host sync now (reads the scale once for the run log); none per step afterwards
    except the telemetry flush every ``flush_every`` steps. Without a scaler: one multi-tensor
    finiteness check per step and a cheap hook call per parameter per backward pass.
    """
    refuse_engine(scaler, model, optimizer)
    return Watch(
        scaler,
        model,
        optimizer,
        telemetry,
        precision=precision,
        policy=AttachPolicy(min_scale, max_scale, hysteresis, consecutive_hysteresis, on_collapse),
        ema=ema,
        recorder=RecorderOptions(flight_recorder, on_spike, snapshot_every, signatures),
    )


class Watch(TriageSurface, AutopsySurface, ResumeSurface, SkipSteps, UpdateProbes):
    """Handle returned by :func:`watch`: ``findings()``, ``report()``, ``close()``; a context
    manager (``close`` on exit); ``state_dict()`` / ``load_state_dict()`` for a resume and
    ``ampguard.autopsy(handle)`` / ``ampguard.triage(handle)`` on its spikes.

    ``steps`` counts optimizer steps seen (one per ``scaler.update``, applied or skipped).
    """

    def __init__(
        self,
        scaler: Any,
        model: torch.nn.Module,
        optimizer: Any,
        telemetry: Any,
        *,
        precision: str | None = None,
        policy: AttachPolicy | None = None,
        framework: str | None = None,
        loss_from_scaler: bool = True,
        grads_from_optimizer_hooks: bool = True,
        requested_precision: str | None = None,
        ema: Any = None,
        clip_grad_norm: float | None = None,
        recorder: RecorderOptions | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        #: EMA / teacher weights measured between the first optimizer's steps (core.ema)
        self.emas = as_watches(ema, model)
        watched = _seam.adapt(scaler)
        self.optimizers = as_optimizer_list(optimizer)
        self.policy = policy or AttachPolicy()
        self.framework = framework
        enabled = watched is not None and watched.scaled
        self.precision = resolve_precision(precision, enabled, requested_precision is not None)
        if precisions.REGISTRY[self.precision].needs_scaler and not enabled:
            warn_no_scaler(framework)
        if self.policy.active and not (watched is not None and enabled and watched.correctable):
            what = (
                "this loop has none"
                if watched is None or not enabled
                else (f"{watched.name} keeps its own")
            )
            raise ValueError(
                f"min_scale, max_scale and hysteresis need an enabled GradScaler (fp16); {what}"
            )
        options = recorder or RecorderOptions()
        every = check_signatures(options.signatures)
        cannot = _skip.cannot_skip(watched, self.optimizers)
        config = spike_config(options, self.optimizers, framework or "this loop", cannot)
        #: the scaler handed to watch() while it scales the loss (None: no loss scale in use)
        self.scaler = scaler if enabled else None
        self._scaler: WatchableScaler | None = watched
        if watched is not None and watched.watched:
            raise ValueError(
                "scaler is already watched by ampguard; close() the other handle first"
            )
        # Integrations that see the loss and the final gradients in their own hooks turn these off.
        self._loss_from_scaler = loss_from_scaler and watched is not None
        self._grads_from_hooks = grads_from_optimizer_hooks
        self._done = 0
        self._closed = False
        self._grads_seen = False
        self._framework_flags: dict[int, bool] = {}
        self._collapses_seen = 0
        self._collapsing = False
        self.source = WatchSource(
            model, self.optimizers, watched, self.precision, self.policy, framework
        )
        if requested_precision is not None:
            self.source.requested_precision = requested_precision
        self.source.clip_grad_norm = clip_grad_norm  # a framework that clips says at what norm
        self.telemetry = resolve_telemetry(telemetry)
        _telemetry.attach(self.telemetry, self.source)
        self._hooks: list[Any] = []
        self._notes: list[Finding] = []  # findings an integration adds (e.g. AG122)
        self._on_close: list[Any] = []  # integrations' undo callbacks (remove their wrappers)
        self._persisted: list[dict[str, Any]] = []  # findings already in the event log
        self._state = PolicyState(self.policy) if self.policy.active else None
        dev = self.source.device
        self._interventions = torch.zeros(3, dtype=torch.int64, device=dev)
        self._first_intervention = torch.zeros(3, dtype=torch.int64, device=dev)
        self._backward_end: BackwardEnd | None = None
        #: the Guard's flight recorder and spike policy on this loop (None: both off)
        scaled = self.source.loss_scaler is not None
        self.recorder = (
            None
            if config is None
            else AttachRecorder(config, model, self.optimizers, dev, self.telemetry, scaled)
        )
        self._signatures = attach_signatures(
            model, every, lambda: self._done, self.recorder is not None
        )
        self._batches = 0  # batches handed to record_batch (ampguard.triage replays them)
        self._skipped_window = 0
        if watched is None and self.recorder is not None and self.recorder.acts:
            for opt in self.optimizers:  # bf16/fp32: the step is skipped in Python
                self.on_close(_skip.wrap_step(opt, self._decide, self._skipped, self._flag_now))
        if watched is not None:
            watched.attach(self, {id(o) for o in self.optimizers})
        else:
            primary = self.optimizers[0]
            self._hooks = [
                primary.register_step_pre_hook(self._pre_step),
                primary.register_step_post_hook(self._post_step),
            ]
            # the gradient sample is taken when backward ends: before the loop clips them
            self._backward_end = BackwardEnd(self.source.params, self._sample_after_backward)
        self._update_window = 0  # the window of the optimizer step in progress
        self._stagnation = self._watch_stagnation(model)
        if self.emas:  # the EMA's update falls between two steps of the first optimizer
            self._hooks.append(self.optimizers[0].register_step_post_hook(self._after_ema))
            self._ema_window = 0

    # ------------------------------------------------------------------ public
    @property
    def run_dir(self) -> Path:
        """The run folder (the telemetry's)."""
        return self.telemetry.run_dir

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    @property
    def steps(self) -> int:
        """Optimizer steps seen (applied or skipped). No sync."""
        return self._done

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for overflow so far. Cost: one host sync (flushes the telemetry)."""
        self.telemetry.flush()
        return sum(self.telemetry.skip_counts().values())

    @property
    def stagnation(self) -> StagnationProbe | None:
        """The probe of bf16/fp16 weights whose updates round away (AG175), over the first
        optimizer's parameters; ``None`` when they are all fp32 (then it costs nothing)."""
        return self._stagnation

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record this micro-batch's loss in a loop without a scaler. Cost: no host sync.

        With an enabled scaler the loss handed to ``scaler.scale`` is recorded automatically and
        this call does nothing.
        """
        if (
            not self._loss_from_scaler
            and not self._closed
            and isinstance(loss, torch.Tensor)
            and loss.numel() == 1
        ):
            self.telemetry.on_backward(loss.detach())
            if self.recorder is not None:
                self.recorder.add_loss(loss)

    def findings(self) -> list[Finding]:
        """The AG1xx findings over the run so far (rules + attach mode); writes findings.json.

        Cost: one host sync (flush) and a read of the run log.
        """
        if self._closed:
            return [Finding.from_dict(d) for d in runlog.read_findings(self._findings_path)]
        found = self.telemetry.findings()
        self._check_collapse(in_step=False)
        return self._merge(found)

    def report(self) -> Path:
        """Write ``report.html`` into the run folder and return its path. Cost: as findings()."""
        from ampguard.reporting import report as write_report

        if not self._closed:
            self.findings()
        return write_report(self.run_dir)

    def close(self) -> None:
        """Stop observing (the scaler and optimizer are restored), flush, write findings.json.

        Idempotent. Cost: one host sync.
        """
        if self._closed:
            return
        if self._scaler is not None:
            self._scaler.detach()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._backward_end is not None:
            self._backward_end.close()
        while self._on_close:
            self._on_close.pop()()
        if self._signatures is not None:
            self._signatures.remove()
        try:
            if self.recorder is not None:
                self.recorder.close()  # the last spikes warn; the SIGTERM handler goes
            self.telemetry.close()
            self._check_collapse(in_step=False)
            path = self._findings_path
            rules_found = (
                [Finding.from_dict(d) for d in runlog.read_findings(path)] if path.exists() else []
            )
            self._merge(rules_found)
        finally:
            self._closed = True

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ for integrations
    # What the framework integrations (ampguard.integrations.*) tell a Watch. No sync.
    def add_finding(self, finding: Finding) -> None:
        """Report ``finding`` with the run's (e.g. AG122, made by an integration that knows
        what precision was requested)."""
        self._notes.append(finding)

    @property
    def added_findings(self) -> list[Finding]:
        """The findings given to :meth:`add_finding` (a copy)."""
        return list(self._notes)

    def note_framework_skip(self, skipped: bool) -> None:
        """A framework's own skipped-step flag for the step just recorded (a host bool; AG120
        compares it with what the scaler did)."""
        self._framework_flags[self._done] = bool(skipped)

    @property
    def framework_skip_flags(self) -> dict[int, bool]:
        """Step -> the framework's skipped flag, as given to :meth:`note_framework_skip` (a
        copy)."""
        return dict(self._framework_flags)

    def on_close(self, undo: Callable[[], Any]) -> None:
        """Call ``undo()`` when this Watch closes (an integration removing its wrappers; last
        registered, first called)."""
        self._on_close.append(undo)

    def observe_grads(self) -> None:
        """Sample the (unscaled) gradients of a scaler-free step once (an integration calls it
        where they are final). Cost: no host sync."""
        if self._scaler is None and not self._closed and self.recorder is not None:
            self.recorder.begin(self._done + 1)  # the window's gradients are final here
        if self._scaler is None and not self._closed and not self._grads_seen:
            self._grads_seen = True
            self.telemetry.on_grads(self._done + 1, False)

    def interventions(self) -> tuple[list[int], list[int]]:
        """Attach-mode guard interventions: counts of (absorbed overflows, floored backoffs,
        capped growths) and the first step of each (0: none). Cost: one host sync."""
        return self._interventions.tolist(), self._first_intervention.tolist()

    # ------------------------------------------------------------------ tap callbacks (hot path)
    # The ScalerListener side of the seam (ampguard.integrations._seam): the scaler calls these.
    def on_scaler_loss(self, loss: torch.Tensor) -> None:
        """``scaler.scale(loss)`` was called with this (unscaled) loss."""
        if self._loss_from_scaler:
            self.telemetry.on_backward(loss)
            if self.recorder is not None:
                self.recorder.add_loss(loss)

    def on_scaler_grads(self, scaled: bool) -> None:
        """The gradients are final and not yet unscaled (``scaled``: they carry the scale)."""
        view = self.source.loss_scaler
        if self.recorder is not None:  # the window begins: detector, ring, gradient norms
            self.recorder.begin(self._done + 1, view.inv_scale() if scaled and view else None)
        if self._grads_seen:
            return  # one gradient sample per step, taken before the first unscale
        self._grads_seen = True
        self.telemetry.on_grads(self._done + 1, scaled and self.source.loss_scaler is not None)

    def on_scaler_step(self, optimizer: Any) -> torch.Tensor | None:
        """The scaler is about to step ``optimizer``: the flag that skips it on a loss spike."""
        if self.recorder is None:
            return None
        self.recorder.begin(self._done + 1)
        return self.recorder.skip_flag(self._done + 1)

    def on_scaler_update(self, outcome: StepOutcome) -> None:
        """The step is over: record its flags (and, with guard features, correct the scale)."""
        step = self._done + 1
        status = self._status(outcome)
        tensors = None
        if self._state is not None and self._scaler is not None and not outcome.manual:
            tensors = self._scaler.guard_tensors()  # None: the scaler keeps its own floor
        if self._state is not None and tensors is not None:
            scale, tracker = tensors
            before = outcome.scale_before
            collapse, kinds = self._state.apply(
                scale,
                tracker,
                before if isinstance(before, torch.Tensor) else scale.new_full((), before),
                as_tensor(outcome.found_all, scale.device),
            )
            status = results.add_collapse(
                as_tensor(status, scale.device), collapse, len(self.optimizers)
            )
            self._count_interventions(kinds, step)
        norm = outcome.grad_norm
        dev = self.source.device
        self._record_step(
            status,
            None if norm is None else as_tensor(norm, dev),
            as_tensor(outcome.scale_before, dev) if self.source.loss_scaler else None,
        )

    def _status(self, outcome: StepOutcome) -> torch.Tensor | int:
        """The packed flags: on the device where the scaler's flags are device tensors, an int
        where the scaler had read them already. No sync."""
        n = len(self.optimizers)
        found = [outcome.found.get(id(o), False) for o in self.optimizers]
        tensors = [f for f in found if isinstance(f, torch.Tensor)]
        status: torch.Tensor | int
        if tensors:
            dev = tensors[0].device
            status = results.pack([as_tensor(f, dev) for f in found], None)
        else:
            status = sum(1 << i for i, f in enumerate(found) if f)
        if outcome.nonfinite is not None:
            status = results.observed(outcome.nonfinite, n) + status
        return status

    def _count_interventions(self, kinds: torch.Tensor, step: int) -> None:
        kinds = kinds.to(self._interventions.device)
        self._interventions.add_(kinds.long())
        first = self._first_intervention
        first.copy_(torch.where(kinds & (first == 0), step, first))

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._grads_from_hooks:
            self.observe_grads()

    def _sample_after_backward(self) -> None:
        """A backward pass ended: (re-)sample the gradients, unscaled and not yet clipped; the
        window's last backward leaves the sample. Cost: no host sync."""
        if not self._closed:
            self._grads_seen = True
            self.telemetry.on_grads(self._done + 1, False)
            if self.recorder is not None:
                self.recorder.sample_grads()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._closed:
            # the framework owns this step and applied whatever it got: record non-finite
            # gradients, change nothing (one multi-tensor check, no sync)
            found = nonfinite_flag(self.source.params, self.source.device)
            self._record_step(results.observed(found, len(self.optimizers)))

    def _record_step(
        self,
        status: torch.Tensor | int | None,
        grad_norm: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        tel, window, rec = self.telemetry, self._done + 1, self.recorder
        flushes = tel.flushes
        if rec is not None and status is not None:
            rec.begin(window)  # a window no earlier event began (no gradients seen)
            bits = rec.status_bits(len(self.optimizers))
            status = status if bits is None else bits + status
        tel.on_step(window, status, grad_norm)
        self._done += 1
        if self._signatures is not None:  # the next window: hooked only if it is recorded
            self._signatures.window(self._done)
        self._grads_seen = False
        if rec is not None:
            rec.end(window, None if isinstance(status, int) or status is None else status, scale)
        if tel.flushes != flushes:
            self._check_collapse(in_step=True)
            if rec is not None:
                rec.settle()  # the flush read the device anyway: the spikes warn now

    # ------------------------------------------------------------------ collapse
    def _check_collapse(self, in_step: bool) -> None:
        """Act on collapses found by the last flush: raise (only from inside a step, where the
        policy asks for it) or warn once per episode."""
        if self.policy.min_scale is None:
            return
        total = self.telemetry.skip_counts()["collapse"]
        new, self._collapses_seen = total - self._collapses_seen, total
        if not new:
            self._collapsing = False
            return
        msg = (
            f"loss scale collapsed: gradients overflow even at min_scale="
            f"{self.policy.min_scale:g} ({total} collapsed steps so far, last flush at step "
            f"{self._done}). Try bf16, keeping the overflowing module in fp32 "
            "(ampguard.locate names it), or a lower learning rate."
        )
        if self.policy.on_collapse == "raise" and in_step:
            raise ScaleCollapseError(msg)
        if not self._collapsing:
            warnings.warn(msg, RuntimeWarning, stacklevel=user_stacklevel())
        self._collapsing = True

    # ------------------------------------------------------------------ findings
    @property
    def _findings_path(self) -> Path:
        return self.run_dir / runlog.FINDINGS

    def _merge(self, rules_found: list[Finding]) -> list[Finding]:
        own = _findings.attach_findings(self)
        fresh = [f for f in own if f.to_dict() not in self._persisted]
        runlog.append_findings(self.run_dir, fresh)  # so ag.report / `ampguard report` show them
        self._persisted.extend(f.to_dict() for f in fresh)
        codes = {f.code for f in own}
        merged = [f for f in rules_found if f.code not in codes] + own
        runlog.write_json_atomic(self._findings_path, [f.to_dict() for f in merged])
        return merged
