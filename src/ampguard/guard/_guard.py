"""Guard: the AMP step orchestrator.

One object replaces ``autocast`` / ``scaler.scale(loss).backward()`` / ``unscale_`` / clip /
``scaler.step`` / ``scaler.update`` / ``zero_grad`` and does them in the right order, with a
floor, a cap, hysteresis, a skipped-step signal and state that resumes bitwise.

>>> guard = Guard(model, optimizer, precision="fp16", clip_grad_norm=1.0)
>>> for x, y in data:
...     with guard.autocast():
...         loss = loss_fn(model(x), y)
...     guard.backward(loss)
...     result = guard.step()          # result.applied, result.overflow, result.grad_norm
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ampguard._util.stack import user_stacklevel
from ampguard.core import scheduler_callback
from ampguard.core.policy import PrecisionPolicy
from ampguard.core.results import StepResult
from ampguard.core.resume import ResumeWarmup
from ampguard.core.scaler import ScaledLossScale, ScalerConfig
from ampguard.core.stagnation import StagnationProbe
from ampguard.distributed import DistributedState
from ampguard.findings import Finding
from ampguard.forensics.islands import Pattern as Fp32Pattern
from ampguard.fp8 import Conversion
from ampguard.guard import _config, _flags, _parts, _rescue, _signatures, _spikes, _summary, _window
from ampguard.guard import _state as guard_state
from ampguard.telemetry import Telemetry

__all__ = ["Guard"]


class Guard:
    """Guarded mixed-precision training step for ``model`` and one or more optimizers.

    ``step()`` runs, once per accumulation window: unscale (fused multi-tensor unscale + inf
    check) -> clip the *unscaled* gradients -> ``optimizer.step`` unless they overflowed ->
    scale update -> ``zero_grad(set_to_none=True)`` -> registered schedulers and callbacks, only if
    the step was applied.

    Cost: the same host syncs as ``torch.amp.GradScaler``: one per window for optimizers that
    step in Python (one in all, where torch has one per optimizer), none for fused optimizers
    (``_step_supports_amp_scaling``), whose step flags are read lazily; reading
    ``StepResult.applied`` there, or registering schedulers/callbacks, syncs once per window.
    bf16 and fp32 windows get the same non-finite check (``skip_nonfinite=True``, the default):
    one host sync per window, none for fused optimizers (their ``found_inf``);
    ``skip_nonfinite=False`` never syncs there, except with ``contain_nonfinite_microbatches``
    (a window whose micro-batches were all dropped must skip).

    ``restore_buffers_on_skip=True`` (the default) puts the buffers a skipped window's forward
    changed (BatchNorm statistics...) back as they were (``ampguard.core.buffer_restore``: one
    multi-tensor copy per window, no sync). With bf16/fp16 weights, sampled windows measure the
    share of updates that round away (``ampguard.core.stagnation``, AG175; no sync).


    Args:
        model: The ``torch.nn.Module`` being trained; its parameters must be the optimizers'.
        optimizer: One ``torch.optim.Optimizer`` or a list of them (one step flag each).
        precision: ``"auto"`` (bf16 where the device supports it, else fp16) or a name in
            ``ampguard.precisions.REGISTRY`` (``ampguard.precisions.names()``; the precision
            table of the docs says what each runs and needs: fp16 has a dynamic loss scaler,
            fp8 converts the linears planned by ``fp8_plan``); or a ``{layer: format}`` dict /
            an ``ampguard.RecipeCertificate``: each Linear in its own format (emulated).
        scaler: An ``ampguard.ScalerConfig`` for the fp16 loss scaler (floor, cap, hysteresis,
            ``on_collapse``); used only when the precision resolves to fp16.
        accumulation_steps: Micro-batches per optimizer step; ``backward()`` divides the loss
            by this number.
        clip_grad_norm: Clip the total norm of the *unscaled* gradients to this value (None:
            no clipping); ``StepResult.grad_norm`` then holds the norm before clipping.
        schedulers: LR schedulers stepped after every *applied* step only, never on a skip.
        contain_nonfinite_microbatches: Drop a micro-batch whose gradients are non-finite and
            keep the rest of the window (its step applies unless every micro-batch was dropped).
        resume_warmup: An ``ampguard.ResumeWarmup``: after a resume that lost the loss scale,
            lower the learning rate while the scale finds its level again.
        audit_every: Under a process group, compare the Guard's state across ranks every this
            many windows (None: never).
        on_desync: What a failed cross-rank audit does: ``"raise"`` (``ampguard.DesyncError``),
            ``"warn"`` or ``"repair"`` (copy rank 0's state to the others).
        process_group: The ``torch.distributed`` group to agree on skips and audit over
            (None: the default group when one is initialised).
        peer_timeout: Seconds ampguard's own collectives wait for the other ranks before they
            raise ``ampguard.PeerFailureError`` naming the ranks that did not answer (None:
            the timeout given to ``init_process_group`` when one was set, else 600).
        telemetry: A run folder (str or path) or an ``ampguard.Telemetry``: device-side step
            records flushed every N steps, the findings and ``report.html`` at ``close()``.
        keep_fp32: Modules to run outside autocast in fp32: fnmatch patterns over
            ``model.named_modules()`` names (``"head"``, ``"blocks.*.attn"``) and/or module
            classes (``torch.nn.BatchNorm2d`` matches every instance); saved by name.
        forensics: After an overflow, trace the next windows op by op and diagnose the next
            overflow (AG301-AG305); with ``step(batch=..., loss_fn=...)`` the failing batch is
            replayed with ``ampguard.locate`` from the RNG state its forward started from.
        auto_fallback: Implies ``forensics``: keep a module diagnosed as an fp16 overflow
            (also an absorbed one) in fp32 from the next step on, and record the change
            (AG306); under ``precision="fp8"`` move a layer drifting out of fp8's window back
            to bf16 (AG113).
        coverage_step: Trace window N once and keep its autocast coverage (AG310/AG311).
        fp8_plan: Under ``precision="fp8"``: an ``ampguard.Fp8Plan`` naming the layers that may
            convert (None: every eligible Linear).
        skip_nonfinite: Without a loss scaler (bf16/fp32), skip a window whose gradients are
            non-finite instead of applying it (one host sync per window; False: none).
        restore_buffers_on_skip: Put back the buffers (BatchNorm statistics, ...) that a
            skipped window's forward changed, so a skip leaves no trace (default True).
        stagnation_rescue: For bf16/fp16 parameters: ``"kahan"`` or ``"stochastic"`` runs their
            optimizer step in fp32 and writes it back through a Kahan buffer or by stochastic
            rounding, every layer; ``"auto"`` only the layers the stagnation probe finds losing
            updates (AG175, AG177); None: off (``ampguard.core.rescue``).
        fp32_optimizer_states: Keep the optimizer states of bf16/fp16 parameters in fp32 (AG176).
        ema: EMA / teacher modules the optimizer does not own (or ``ampguard.watch_ema``
            objects): their lost updates are measured (AG175) and ``update()`` is rescued.
        flight_recorder: Windows the device ring buffer keeps (loss, LRs, loss scale, flags,
            per-parameter gradient norms, sampled update ratios; no host sync; True: 256,
            False: none). See ``docs/spikes.md``.
        snapshot_every: Windows between snapshots (weights, optimizer, schedulers, loss
            scale, RNG) for ``on_spike="rewind"`` and ``ampguard.autopsy``.
        snapshot: True (host memory: one copy of the model and optimizer state, two kept),
            a folder (on disk) or False.
        on_spike: What a loss spike (detected on the device) does: ``"warn"`` (default),
            ``"skip"`` the window, ``"rewind"`` to the last snapshot, ``"raise"``
            ``ampguard.LossSpikeError``, or None (no detection). Each is an AG180 finding.
        signatures: Record sync-free per-module bit-sum signatures for ``ampguard.triage``
            (True: one window in 32, the rest compared on the loss; N: one in N, 1: every
            window; default False). See ``docs/triage.md``.

    Raises:
        TypeError: An argument of the wrong type (the message names it).
        ValueError: A value outside what the argument allows (the message names both).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        precision: Any = "auto",
        scaler: ScalerConfig | None = None,
        accumulation_steps: int = 1,
        clip_grad_norm: float | None = None,
        *,
        schedulers: Sequence[Any] = (),
        contain_nonfinite_microbatches: bool = False,
        resume_warmup: ResumeWarmup | None = None,
        audit_every: int | None = 100,
        on_desync: str = "raise",
        process_group: Any = None,
        peer_timeout: float | None = None,
        telemetry: str | os.PathLike | Telemetry | None = None,
        keep_fp32: Sequence[Fp32Pattern] | Fp32Pattern | None = None,
        forensics: bool = False,
        auto_fallback: bool = False,
        coverage_step: int | None = None,
        fp8_plan: Any = None,
        skip_nonfinite: bool = True,
        restore_buffers_on_skip: bool = True,
        stagnation_rescue: str | None = None,
        fp32_optimizer_states: bool = False,
        ema: Any = None,
        flight_recorder: int | bool = _spikes.DEFAULT_CAPACITY,
        snapshot_every: int = _spikes.DEFAULT_SNAPSHOT_EVERY,
        snapshot: bool | str | os.PathLike = True,
        on_spike: str | None = "warn",
        signatures: bool | int = False,
    ) -> None:
        # All or nothing: 1. check every argument (ampguard.guard._config), 2. create the
        # resources (peer group, run folder), 3. only then touch the model (fp8 layers, keep_fp32
        # hooks); a failure in 3 undoes 3 and releases the run folder (ampguard.guard._parts)
        config = _config.check(**_config.arguments(locals()))
        self.restore_buffers_on_skip = config.restore_buffers_on_skip
        self.peer_timeout = config.peer_timeout
        self.resume_warmup = config.resume_warmup
        # the step's state, shared with the helpers of this package (ampguard.guard._step_state)
        self._state = _parts.step_state(config)
        for sched in config.schedulers:
            self.on_applied(scheduler_callback(sched))
        _parts.attach(self, self._state, config)

    # ------------------------------------------------------------------ public properties
    @property
    def precision(self) -> str:
        """The resolved precision now (a name in ``ampguard.precisions.REGISTRY``); changes after a
        fallback."""
        return self._state.policy.precision

    @property
    def fp8(self) -> Conversion | None:
        """Under precision="fp8": ``.layers`` (converted to fp8), ``.kept`` (left in bf16),
        ``.recipe``, ``.emulated``, ``.plan``; else None."""
        return self._state.fp8

    @property
    def policy(self) -> PrecisionPolicy:
        """The resolved ``PrecisionPolicy`` (device type, dtype, scaler need)."""
        return self._state.policy

    @property
    def scale(self) -> float:
        """Current loss scale as a float (1.0 when no scaler is in use). Cost: one host sync."""
        _flags.drain(self._state)
        return self._state.loss_scale.scale()

    @property
    def uses_scaler(self) -> bool:
        """True while a loss scaler is active (fp16 and no fallback happened)."""
        return self._state.scaled

    @property
    def resume(self) -> dict[str, Any] | None:
        """Set after a resume: ``{"step", "scale_reset", "saved_scale", "gap_bits", "warmup"}``
        (plus ``"previous_scale"`` once known); else None."""
        return self._state.resume.info

    @property
    def steps(self) -> int:
        """Accumulation windows completed (optimizer step attempts, applied or skipped)."""
        return self._state.steps

    @property
    def skipped_steps(self) -> int:
        """Windows whose step was skipped (fp16 overflow, non-finite gradients without a scaler,
        collapse). Cost: syncs if flags are pending."""
        _flags.drain(self._state)
        return self._state.counts.skipped

    # ------------------------------------------------------------------ telemetry source
    # What Telemetry reads (ampguard.telemetry.source.TelemetrySource; with model, optimizers,
    # precision, scaler_config, accumulation_steps, clip_grad_norm and
    # contain_nonfinite_microbatches above). No sync.
    @property
    def device(self) -> torch.device:
        """The device of the parameters (where the scaler and telemetry tensors live)."""
        return self._state.device

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters the optimizers update, in optimizer and group order (do not modify
        the list)."""
        return self._state.params

    @property
    def requested_precision(self) -> str:
        """The ``precision=`` argument as given (e.g. "auto"); ``precision`` is what it
        resolved to."""
        return self._state.requested_precision

    @property
    def loss_scaler(self) -> ScaledLossScale | None:
        """The live loss scale (an ``ag.LossScaler``, or the fixed ``StaticLossScale``: its
        ``scale_tensor`` and ``inv_scale()`` read without a sync), or None when no scaler is in
        use (bf16/fp32, or after a fallback)."""
        scale = self._state.loss_scale
        return scale if isinstance(scale, ScaledLossScale) else None

    # the constructor's arguments, as checked (read-only)
    @property
    def model(self) -> torch.nn.Module:
        """The trained model."""
        return self._state.model

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers, in the order given (one step flag each)."""
        return self._state.optimizers

    @property
    def scaler_config(self) -> ScalerConfig:
        """The ``ScalerConfig`` in use (the default one when ``scaler=None``)."""
        return self._state.config

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._state.accumulation_steps

    @property
    def clip_grad_norm(self) -> float | None:
        """The clipping norm of the unscaled gradients, or None."""
        return self._state.clip_grad_norm

    @property
    def skip_nonfinite(self) -> bool:
        """Whether a window with non-finite gradients skips without a loss scaler."""
        return self._state.skip_nonfinite

    @property
    def contain_nonfinite_microbatches(self) -> bool:
        """Whether a non-finite micro-batch is dropped from its window."""
        return self._state.contain_microbatches

    # ------------------------------------------------------------------ the training step
    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast for the forward pass in the resolved precision.

        Under DDP the forward of every micro-batch but the window's last runs in ``no_sync()``,
        so gradients are all-reduced once per window. Cost: no host sync.
        """
        with _window.forward(self._state):
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss / accumulation_steps`` (times the loss scale under fp16).

        ``kwargs`` go to ``Tensor.backward`` (e.g. ``retain_graph``). Cost: no host sync.
        """
        _window.backward(self._state, loss, kwargs)

    def step(
        self,
        *,
        batch: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> StepResult:
        """Finish a micro-batch; at the end of a window, update the parameters.

        Returns a ``StepResult``. On the first ``accumulation_steps - 1`` calls of a window
        nothing is touched and ``applied`` is False. ``kwargs`` go to ``optimizer.step``.
        With ``forensics``/``auto_fallback``, ``batch`` and ``loss_fn(model, batch)`` let an
        overflowing step be replayed with ``ampguard.locate`` (fp16 vs fp32).
        Cost: see the class docstring (torch's own syncs, no more); an armed forensics window
        or a replay adds its own (see the ``forensics`` argument).
        """
        return _window.step(self._state, self, batch, loss_fn, kwargs)

    def on_applied(self, fn: Callable[[StepResult], Any]) -> Callable[[StepResult], Any]:
        """Register ``fn(result)`` to run after every *applied* step (LR schedulers, EMA, ...).

        Skipped steps never advance what is registered here. Usable as a decorator. With a fused
        optimizer this costs one host sync per window (the skip flag must be read).
        """
        if not callable(fn):
            raise TypeError(f"on_applied needs a callable, got {type(fn).__name__}")
        self._state.callbacks.append(fn)
        return fn

    @property
    def fallback(self) -> dict[str, Any] | None:
        """``{"step", "from", "to"}`` if a collapse fallback switched precision, else None."""
        return self._state.fallback

    # ------------------------------------------------------------------ summary
    def diagnostics(self, last: int = 8) -> dict[str, Any]:
        """A summary of the run so far, from what the Guard already keeps.

        Current scale, skipped steps (total and by cause: ``skipped_by_cause`` splits them into
        ``overflow``, ``collapse``, ``nonfinite`` (no scaler) and ``nonfinite_forward``, the
        fp16 skips whose loss was NaN/inf, never counted as an overflow), scale changes, the
        last ``last`` scales with their steps, consecutive skips now, micro-batches dropped,
        fallbacks applied, precision, resume and warm-up state. Cost: one host sync (a few
        scalars and the 32-entry scale history); nothing is recomputed.
        """
        return _summary.diagnostics(self._state, last)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bitwise, as plain tensors/numbers/strings.

        Loads under ``torch.load(weights_only=True)``. Save at a window boundary (after
        ``step()`` applied or skipped): gradients of a half-finished window are not saved.
        Cost: one host sync.
        """
        _flags.drain(self._state)
        if self._state.telemetry is not None:  # a full run-log disk never fails a checkpoint
            self._state.telemetry.flush_deferred()
        if self._state.micro:
            warnings.warn(
                f"Guard.state_dict() called mid-window ({self._state.micro} of "
                f"{self._state.accumulation_steps} micro-batches); their gradients are not saved",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return guard_state.to_dict(self._state, self._state.resume.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict`` output; raises ``ValueError`` on a malformed state.

        All or nothing: the whole state is checked before anything is set, so a load that
        raises leaves this Guard exactly as it was. The precision given to this Guard's
        constructor wins over the saved one, except that a recorded automatic fallback from
        that same precision is resumed; both cases warn.
        """
        self.apply_state(self.check_state(state))

    def check_state(self, state: Any) -> guard_state.Plan:
        """Check a ``state_dict()`` output against this Guard without changing anything (the
        checkpoint loader checks every part of a checkpoint before it loads any); the plan
        ``apply_state()`` carries out. ``ValueError`` naming the bad field. Cost: none."""
        return guard_state.check(self._state, state)

    def apply_state(self, plan: guard_state.Plan) -> None:
        """Carry out a plan of ``check_state()`` and record the resume (run log, resume
        warm-up). Cost: one host sync (pending flags, the resume check)."""
        saved = guard_state.apply(self._state, plan)
        self._mark_resume(scale_reset=plan.restart_scale, saved_scale=saved)
        self._state.resume.load_state_dict(plan.resume)  # a warm-up ramp still running

    def _mark_resume(self, *, scale_reset: bool, saved_scale: float | None = None) -> None:
        # telemetry continues the run log (and the step count, for a checkpoint without Guard
        # state) and returns the scale the run had before the interruption
        previous = None
        if self._state.telemetry is not None:
            resumed = self._state.telemetry.on_resume(self._state.steps, scale_reset, saved_scale)
            self._state.steps, previous = resumed.step, resumed.previous_scale
        self._state.resume.mark(self._state.steps, scale_reset=scale_reset, saved_scale=saved_scale)
        if previous is not None:
            self.check_resume(previous)

    def check_resume(self, previous_scale: float) -> float | None:
        """Compare the resumed scale with the one the run had right before the interruption.

        ``previous_scale`` comes from the run log (telemetry passes it on resume). Returns the gap
        in powers of two; starts the ``resume_warmup`` ramp when the gap is large.
        Cost: one host sync.
        """
        current = self.scale if self._state.scaled else None
        return self._state.resume.check(self._state.steps, previous_scale, current)

    # ------------------------------------------------------------------ telemetry
    @property
    def telemetry(self) -> Telemetry | None:
        """The attached ``ampguard.Telemetry`` (``telemetry=`` argument), or None."""
        return self._state.telemetry

    @property
    def stagnation(self) -> StagnationProbe | None:
        """The probe measuring, per layer, the share of updates that round away in bf16/fp16
        weights (``.shares()``, ``.stagnant()``: one host sync each; AG175 in ``findings()``),
        or None when every trained parameter is fp32."""
        return self._state.stagnation

    @property
    def rescue(self) -> _rescue.GuardRescue | None:
        """The stagnation rescue (``stagnation_rescue=``, ``fp32_optimizer_states=``, ``ema=``):
        ``.decisions``, ``.applied()`` (one host sync), ``.bytes_per_param()``, ``.emas``; or
        None."""
        return self._state.rescue

    @property
    def flight_recorder(self) -> _spikes.SpikeWatch | None:
        """The flight recorder and loss-spike policy: ``.ring`` (the device ring buffer,
        ``.ring.rows()`` reads it), ``.events`` (the spikes seen), ``.snapshots``, ``.memory()``
        (bytes held); None with ``flight_recorder=False`` and ``on_spike=None``. See
        ``docs/spikes.md``."""
        return self._state.spikes

    @property
    def signatures(self) -> Any:
        """The ``ampguard.SignatureRecorder`` of ``signatures=`` (what ``ampguard.triage``
        reads), or None."""
        return self._state.signatures

    @property
    def coverage(self) -> Any:
        """The ``ampguard.Coverage`` of window ``coverage_step`` once it ran, else None."""
        return self._state.forensics.coverage if self._state.forensics is not None else None

    def findings(self) -> list[Finding]:
        """The AG1xx findings over the run so far (needs ``telemetry=``), plus the AG3xx
        diagnoses, fallbacks and coverage of ``forensics``/``auto_fallback``/``coverage_step``
        (those work without telemetry too: then only they are returned, never an error; with
        none of them enabled, an empty list and a warning that says why).

        Also writes ``findings.json`` to the run folder. Cost: one host sync (the telemetry
        flush) and a read of the run log.
        """
        return _summary.findings(self._state)

    def close(self) -> None:
        """Flush telemetry, write ``findings.json``, close the run log and write ``report.html``
        (no-op without telemetry; idempotent; without matplotlib the report is a one-line
        warning). Cost: one host sync; rendering the report takes about a second."""
        _summary.close(self._state)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # keep what was recorded, and let the training loop's own exception propagate
            self.close()
        except Exception as err:  # noqa: BLE001
            warnings.warn(
                f"Guard.close() failed while handling {exc_type.__name__}: {err!r}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    # ------------------------------------------------------------------ distributed
    @property
    def distributed(self) -> DistributedState | None:
        """The ``DistributedState`` (topology, per-rank counters,
        audit), or None when training in one process."""
        return self._state.dist

    def audit(self) -> dict[str, dict[int, Any]]:
        """Run the cross-rank audit now (every rank must call it); ``{}`` when in sync or not
        distributed. Cost: one host sync and one small all-reduce."""
        return (
            self._state.dist.audit(self, reason="requested") if self._state.dist is not None else {}
        )

    # ------------------------------------------------------------------ for ampguard's own modules
    # The Guard's surface for the modules that act on a Guard from outside this class (the
    # checkpoint loader, the cross-rank audit, forensics, StepResult): they use these, never
    # the Guard's private attributes (tests/test_privates.py checks it).
    def settle_pending(self) -> None:
        """Decode, count and act on the pending step flags of fused optimizers (what reading
        ``StepResult.applied`` or ``skipped_steps`` does). Cost: one host sync for all
        pending windows; none when nothing is pending."""
        _flags.drain(self._state)

    @property
    def applied_steps(self) -> int:
        """Windows whose step was applied, as counted so far: pending fused-optimizer flags are
        not settled (read ``skipped_steps`` first for settled totals). Cost: no host sync."""
        return self._state.counts.applied

    def scale_used_at(self, step: int) -> float:
        """The loss scale window ``step`` ran with (one of the last 32 windows: the scale history);
        1.0 without a loss scaler. Cost: one host sync with a scaler, none without."""
        if not self._state.scaled:
            return 1.0
        return self._state.history.used_at(step)

    def scaler_state(self) -> dict[str, Any] | None:
        """The loss scaler's ``state_dict()`` (``scale``, ``growth_tracker``,
        ``hysteresis_tracker``...), or None without a scaler (bf16, fp32, after a fallback).
        Cost: one host sync with a scaler."""
        return self._state.loss_scale.state_dict()

    def restore_counts(
        self, *, steps: int, applied: int, skipped: int, scaler_state: dict[str, Any] | None = None
    ) -> None:
        """Set the window counters (and, with a scaler, its state) to another rank's: the
        audit's repair (``on_desync="repair"``). ``scaler_state`` is ignored without a scaler.
        Cost: no host sync."""
        if self._state.scaled and scaler_state is not None:
            self._state.loss_scale.load_state_dict(scaler_state)
        self._state.steps = steps
        _signatures.window(self._state.signatures, steps)
        self._state.counts.applied = applied
        self._state.counts.skipped = skipped

    def restart_scale(self) -> None:
        """A checkpoint without scaler state: the scale starts again from ``init_scale`` (a
        resume is recorded, see ``resume``). Cost: none beyond the resume check."""
        state = self._state
        if state.scaled:
            state.loss_scale = state.new_loss_scale()
            state.history.reset(state.config.init_scale)
        self._mark_resume(scale_reset=state.scaled)

    def adopt_torch_scaler_state(self, state: dict[str, Any]) -> None:
        """Take over a ``torch.amp.GradScaler.state_dict()`` (scale and growth tracker; torch
        names the tracker ``_growth_tracker`` in that dict). Needs a loss scaler."""
        assert self._state.scaled
        self._state.loss_scale.load_state_dict(
            {"scale": state["scale"], "growth_tracker": state.get("_growth_tracker", 0)}
        )
        self._state.history.reset(float(state["scale"]))  # not init_scale: no spurious scale change
        self._mark_resume(scale_reset=False, saved_scale=float(state["scale"]))


Guard.__module__ = "ampguard.guard"  # its public home: repr and pickles name that path
