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
from ampguard._util.tensors import is_fused as _is_fused
from ampguard._util.tensors import params_of as _params_of
from ampguard.core import _nonfinite, results
from ampguard.core import _state as _guard_state
from ampguard.core._args import (
    as_optimizers,
    check_backward,
    check_flag,
    check_grads_present,
    check_model,
    check_window,
    scheduler_callback,
)
from ampguard.core.buffer_restore import BufferSnapshot
from ampguard.core.containment import MicrobatchBuffer
from ampguard.core.policy import (
    PrecisionPolicy,
    check_parameters,
    device_of,
    resolve_precision,
    supports_bf16,
)
from ampguard.core.results import StepResult
from ampguard.core.resume import ResumeTracker, ResumeWarmup
from ampguard.core.scale_history import ScaleHistory
from ampguard.core.scaler import LossScaler, ScaleCollapseError, ScalerConfig, collect_grads
from ampguard.core.stagnation import StagnationProbe
from ampguard.distributed import DistributedState, check_distributed_options
from ampguard.distributed import attach as _attach_distributed
from ampguard.distributed import rank_telemetry as _rank_telemetry
from ampguard.distributed._peers import resolve_peer_timeout
from ampguard.findings import Finding, count
from ampguard.forensics import _guard as _guard_forensics
from ampguard.forensics import _verdicts
from ampguard.forensics.islands import Pattern as Fp32Pattern
from ampguard.fp8 import _guard as _fp8_guard
from ampguard.reporting._on_close import write_report as _write_report
from ampguard.telemetry import Telemetry
from ampguard.telemetry import attach as _attach_telemetry
from ampguard.telemetry import check_argument as check_telemetry_argument

__all__ = ["Guard", "StepResult"]

_STATE_VERSION = _guard_state.STATE_VERSION
_DRAIN_EVERY = 100  # fused optimizers: settle pending step flags at least this often


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
        precision: ``"auto"`` (bf16 where the device supports it, else fp16), ``"fp16"``
            (with a dynamic loss scaler), ``"bf16"``, ``"fp32"`` or ``"fp8"`` (torchao float8
            linears, see ``fp8_plan``).
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

    Raises:
        TypeError: An argument of the wrong type (the message names it).
        ValueError: A value outside what the argument allows (the message names both).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        precision: str = "auto",
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
    ) -> None:
        # All or nothing (issue 23): 1. check every argument, 2. create the resources (peer
        # group, run folder), 3. only then touch the model (fp8 layers, keep_fp32 hooks); a
        # failure in 3 undoes 3 and releases the run folder, so the model is as it was.
        self.optimizers = as_optimizers(optimizer)
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        check_model(model, params)
        self.model = model
        check_window(accumulation_steps, clip_grad_norm)
        self.skip_nonfinite = check_flag("skip_nonfinite", skip_nonfinite)
        # bf16/fp16 weights: the share of updates that round away (ampguard.core.stagnation)
        self._stagnation = StagnationProbe.of(model, params)
        if scaler is not None and not isinstance(scaler, ScalerConfig):
            raise TypeError(f"scaler must be an ampguard.ScalerConfig, got {type(scaler).__name__}")
        self.accumulation_steps = accumulation_steps
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.scaler_config = scaler or ScalerConfig()
        self.contain_nonfinite_microbatches = bool(contain_nonfinite_microbatches)
        # a skipped window's forward leaves no trace in the buffers (ampguard.core.buffer_restore)
        self.restore_buffers_on_skip = check_flag(
            "restore_buffers_on_skip", restore_buffers_on_skip
        )
        self._device = device_of(params)
        self._requested_precision = precision
        self._policy = resolve_precision(precision, self._device)
        check_parameters(params, self._policy, argument="optimizer")
        self._params = params
        # ampguard's own collectives wait at most peer_timeout seconds (None: the group's own
        # timeout when the user set one, else 10 min; ampguard.distributed._peers)
        self.peer_timeout = resolve_peer_timeout(peer_timeout, process_group)
        check_distributed_options(audit_every, on_desync)
        check_telemetry_argument(telemetry)
        _guard_forensics.check(model, keep_fp32, forensics, auto_fallback, coverage_step)
        # precision="fp8" (ampguard.fp8._guard): the plan checked, torchao imported, the layers
        # chosen; converted to torchao's Float8Linear in step 3
        self._fp8 = _fp8_guard.attach(self, fp8_plan)
        # the buffers a forward updates (fp8's swap to Float8Linear in step 3 adds none)
        self._buffer_snapshot = BufferSnapshot.of(model) if self.restore_buffers_on_skip else None
        # containment: a dropped micro-batch's forward is undone too (one more snapshot)
        self._micro_snapshot = (
            BufferSnapshot.of(model)
            if self._buffer_snapshot is not None and self.contain_nonfinite_microbatches
            else None
        )
        self._scaler = self._make_scaler()
        self._callbacks: list[Callable[[StepResult], Any]] = []
        for sched in schedulers:
            self.on_applied(scheduler_callback(sched))
        self._micro = 0
        self._window_losses: list[torch.Tensor] = []  # this window's losses (skip causes)
        self._loss_bad: torch.Tensor | None = None  # ... as a device flag, at the window's end
        self._steps = 0
        self._counts = results.Counters()
        self._pending: list[tuple[StepResult, torch.Tensor]] = []
        self._fallback: dict[str, Any] | None = None
        self._collapsing = False
        self._history = ScaleHistory(
            self.scaler_config.init_scale if self._scaler else 1.0, self._device
        )
        self._contain: MicrobatchBuffer | None = None
        self._resume = ResumeTracker(resume_warmup)
        self.resume_warmup = resume_warmup
        # 2. distributed (ampguard.distributed): None unless a process group is in play;
        # ampguard's own collectives wait at most peer_timeout seconds (distributed._peers)
        self._dist = _attach_distributed(
            model,
            self._device,
            audit_every=audit_every,
            on_desync=on_desync,
            process_group=process_group,
            containment=self.contain_nonfinite_microbatches,
            params=params,
            peer_timeout=self.peer_timeout,
        )
        telemetry = _rank_telemetry(self._dist, telemetry)  # distributed: rank 0 writes the log
        # telemetry (ampguard.telemetry): device-side step records, flushed every N steps; the
        # run folder is created and locked here (TelemetryError naming it if it cannot be)
        self._telemetry = _attach_telemetry(telemetry, self)
        self._forensics = None
        try:  # 3. the model
            if self._fp8 is not None:
                self._fp8.convert()
                # fp8 telemetry: per-layer amax and flushed shares; with auto_fallback a layer
                # drifting out of fp8's window moves back to bf16 (ampguard.fp8._rescue)
                self._fp8.watch(self, rescue=auto_fallback)
            # forensics (ampguard.forensics._guard): keep_fp32 islands, armed tracing,
            # auto_fallback, coverage_step; None (zero cost) unless one of them is used
            self._forensics = _guard_forensics.attach(
                self,
                keep_fp32=keep_fp32,
                forensics=forensics,
                auto_fallback=auto_fallback,
                coverage_step=coverage_step,
            )
        except BaseException:
            if self._fp8 is not None:
                self._fp8.revert()
            if self._telemetry is not None:
                self._telemetry.release()
            raise

    # ------------------------------------------------------------------ public properties
    @property
    def precision(self) -> str:
        """The resolved precision now ("fp16" | "bf16" | "fp32" | "fp8"); changes after a
        fallback."""
        return self._policy.precision

    @property
    def fp8(self) -> Any:
        """Under precision="fp8": ``.layers`` (converted to fp8), ``.kept`` (left in bf16),
        ``.recipe``, ``.emulated``, ``.plan``; else None."""
        return self._fp8

    @property
    def policy(self) -> PrecisionPolicy:
        """The resolved ``PrecisionPolicy`` (device type, dtype, scaler need)."""
        return self._policy

    @property
    def scale(self) -> float:
        """Current loss scale as a float (1.0 when no scaler is in use). Cost: one host sync."""
        self._drain()
        return self._scaler.scale() if self._scaler is not None else 1.0

    @property
    def uses_scaler(self) -> bool:
        """True while a loss scaler is active (fp16 and no fallback happened)."""
        return self._scaler is not None

    @property
    def resume(self) -> dict[str, Any] | None:
        """Set after a resume: ``{"step", "scale_reset", "saved_scale", "gap_bits", "warmup"}``
        (plus ``"previous_scale"`` once known); else None."""
        return self._resume.info

    @property
    def steps(self) -> int:
        """Accumulation windows completed (optimizer step attempts, applied or skipped)."""
        return self._steps

    @property
    def skipped_steps(self) -> int:
        """Windows whose step was skipped (fp16 overflow, non-finite gradients without a scaler,
        collapse). Cost: syncs if flags are pending."""
        self._drain()
        return self._counts.skipped

    # ------------------------------------------------------------------ telemetry source
    # What Telemetry reads (ampguard.telemetry.source.TelemetrySource; with model, optimizers,
    # precision, scaler_config, accumulation_steps, clip_grad_norm and
    # contain_nonfinite_microbatches above). No sync.
    @property
    def device(self) -> torch.device:
        """The device of the parameters (where the scaler and telemetry tensors live)."""
        return self._device

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters the optimizers update, in optimizer and group order (do not modify
        the list)."""
        return self._params

    @property
    def requested_precision(self) -> str:
        """The ``precision=`` argument as given (e.g. "auto"); ``precision`` is what it
        resolved to."""
        return self._requested_precision

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The live ``LossScaler`` (its ``scale_tensor`` and ``inv_scale()`` read without a
        sync), or None when no scaler is in use (bf16/fp32, or after a fallback)."""
        return self._scaler

    # ------------------------------------------------------------------ the training step
    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast for the forward pass in the resolved precision.

        Under DDP the forward of every micro-batch but the window's last runs in ``no_sync()``,
        so gradients are all-reduced once per window. Cost: no host sync.
        """
        traced = self._forensics.session("forward") if self._forensics else contextlib.nullcontext()
        if self._buffer_snapshot is not None and self._micro == 0:  # the window's first forward
            self._buffer_snapshot.take(self._steps + 1)
        if self._micro_snapshot is not None:  # every micro-batch's forward, under containment
            self._micro_snapshot.take(self._micro_key(self._micro))
        with (
            self._peers("the forward's collectives"),
            self._grad_sync_context(),
            self._policy.autocast(),
            traced,
        ):
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss / accumulation_steps`` (times the loss scale under fp16).

        ``kwargs`` go to ``Tensor.backward`` (e.g. ``retain_graph``). Cost: no host sync.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "loss must be a single-element tensor (reduce it with .mean() or .sum()), got "
                + (
                    f"shape {tuple(loss.shape)}"
                    if isinstance(loss, torch.Tensor)
                    else type(loss).__name__
                )
            )
        check_backward(self._micro, self.accumulation_steps)
        self._window_losses.append(loss.detach())  # a NaN loss is a forward, not an overflow
        if self._telemetry is not None:
            self._telemetry.on_backward(loss)
        if self._dist is not None and self._scaler is not None:
            self._dist.note_loss(loss)  # plain DDP: this rank's overflow origin, no collective
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        if self._scaler is not None:
            loss = self._scaler.scale_loss(loss)
        with self._peers("the gradient reduction in backward"):  # DDP/FSDP2 collectives
            if self._forensics is not None:  # armed or coverage windows trace the backward too
                self._forensics.on_loss(loss)
                with self._forensics.session("backward"):
                    loss.backward(**kwargs)
            else:
                loss.backward(**kwargs)
        self._micro += 1
        if self.contain_nonfinite_microbatches:
            self._contain_microbatch()

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
        if self._forensics is not None:
            self._forensics.check_replay(batch, loss_fn)
        if self._micro == 0:
            raise RuntimeError("Guard.step() called before Guard.backward(loss) in this window")
        if self._micro < self.accumulation_steps:
            return StepResult.in_window(self._steps, len(self.optimizers))
        tel = self._telemetry
        if tel is not None and tel.flush_due:  # on_write_error="raise": fail before the update
            tel.before_update()
        self._micro = 0
        self._loss_bad = results.loss_nonfinite(self._window_losses)
        self._window_losses = []
        if not self.contain_nonfinite_microbatches:  # containment buffers hold the grads
            check_grads_present(self._params)  # e.g. another Guard's step() cleared them
        self._steps += 1
        self._resume.before_step(self.optimizers, self._steps)  # resume warm-up LR ramp
        if self._stagnation is not None:  # a sampled window: the weights before the step
            self._stagnation.before(self._steps)
        try:
            with self._peers("Guard.step()", self._steps):  # e.g. FSDP2's grad-norm all-reduce
                result = (
                    self._step_scaled(kwargs)
                    if self._scaler
                    else _nonfinite.step_unscaled(self, kwargs)
                )
            if self._stagnation is not None and self._stagnation.sampling(self._steps):
                self._stagnation.after(self._steps, self._skip_flag(result))  # before zero_grad
        except BaseException as err:
            if self._telemetry is not None:  # the failed window's loss must not join the next
                self._telemetry.on_abort()
            if self._buffer_snapshot is not None and isinstance(err, ScaleCollapseError):
                self._buffer_snapshot.restore(self._steps)  # the collapsing window was skipped too
            raise
        finally:
            self._resume.after_step(self._steps)
            # also on an exception: the window's grads are already unscaled/clipped in place and
            # must not leak into the next window
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        if self._buffer_snapshot is not None:  # before forensics replays the window's batch
            self._restore_buffers(result)
        if len(self._pending) >= _DRAIN_EVERY:
            self._drain()
        if self._dist is not None:
            self._dist.maybe_audit(self)  # cross-rank audit every `audit_every` windows
        if self._forensics is not None:  # diagnose an armed/replayable overflow, fall back
            self._forensics.on_step(result, batch, loss_fn)
        if self._callbacks and result.applied:
            for fn in self._callbacks:
                fn(result)
        return result

    def on_applied(self, fn: Callable[[StepResult], Any]) -> Callable[[StepResult], Any]:
        """Register ``fn(result)`` to run after every *applied* step (LR schedulers, EMA, ...).

        Skipped steps never advance what is registered here. Usable as a decorator. With a fused
        optimizer this costs one host sync per window (the skip flag must be read).
        """
        if not callable(fn):
            raise TypeError(f"on_applied needs a callable, got {type(fn).__name__}")
        self._callbacks.append(fn)
        return fn

    # ------------------------------------------------------------------ step internals
    def _step_scaled(self, kwargs: dict[str, Any]) -> StepResult:
        scaler = self._scaler
        assert scaler is not None
        dropped, all_dropped = (None, None)
        if self._contain is not None:
            dropped, all_dropped = self._contain.install(self._params)
        fused = [_is_fused(opt) for opt in self.optimizers]
        # Fused optimizers unscale inside their kernel unless the grads must be unscaled first.
        unscale_now = self.clip_grad_norm is not None or not all(fused)
        inv = scaler.inv_scale() if unscale_now else None
        found = []
        for opt in self.optimizers:
            grads = collect_grads(_params_of(opt))
            if self._dist is not None:  # distributed: check the rank-local shards
                grads = self._dist.local_grads(grads)
            f = scaler.unscale_(grads, inv) if unscale_now else scaler.check_(grads)
            found.append(f if all_dropped is None else f + all_dropped)
        # distributed: one async all-reduce of the flags, overlapped with clipping
        agree = (
            None if self._dist is None else self._dist.start_consensus(found, dropped, self._steps)
        )
        tel = self._telemetry
        if tel is not None and self._steps >= tel.next_sample:  # a gradient sample is due
            tel.on_grads(self._steps, not unscale_now)  # fused, no clip: grads still scaled
        grad_norm = self._clip(found)
        if agree is not None and self._dist is not None:  # agree implies _dist
            found, dropped = agree.wait()
            grad_norm = self._dist.plain_tensor(grad_norm)  # FSDP2: a replicated DTensor
        signal = found[0] if len(found) == 1 else torch.stack(found).sum()
        skipped = None
        if dropped is not None:
            skipped = signal > 0  # a window that still updates is no collapse
            signal = signal + dropped.float()  # a dropped micro-batch says the scale is too high
        status = results.pack(found, dropped, self._loss_bad)
        if all(fused):
            # No host sync (as torch): the kernels skip themselves on found_inf.
            for opt, f in zip(self.optimizers, found, strict=True):
                self._fused_step(opt, f, unscale_now, kwargs)
            status = results.add_collapse(status, scaler.update(signal, skipped), len(found))
            self._remember_scale()
            if self._telemetry is not None:
                self._telemetry.on_step(self._steps, status, grad_norm)
            result = StepResult(self._steps, True, grad_norm, None, owner=self)
            self._pending.append((result, status))
            return result
        status = results.add_collapse(status, scaler.update(signal, skipped), len(found))
        self._remember_scale()
        packed = int(status.item())  # the sync torch has in step()
        if self._telemetry is not None:
            self._telemetry.on_step(self._steps, packed, grad_norm)
        flags = results.decode(packed, len(found))
        for opt, f, ok, is_fused in zip(
            self.optimizers, found, flags.applied_per_optimizer, fused, strict=True
        ):
            if is_fused:
                self._fused_step(opt, f, True, kwargs)
            elif ok:
                opt.step(**kwargs)
        result = StepResult(self._steps, True, grad_norm, flags)
        self._settle(self._steps, flags)
        return result

    def _restore_buffers(self, result: StepResult) -> None:
        """A skipped window's forward leaves the buffers as they were before it. Cost: no host
        sync (fused optimizers' lazy flags act on the device)."""
        assert self._buffer_snapshot is not None
        skipped = self._skip_flag(result)
        if isinstance(skipped, torch.Tensor):  # fused: flags still on the device
            self._buffer_snapshot.restore_where(self._steps, skipped)
        elif skipped:
            self._buffer_snapshot.restore(self._steps)

    def _skip_flag(self, result: StepResult) -> bool | torch.Tensor:
        """Whether the window just stepped was skipped: a bool when its flags are on the host,
        else a 0-dim bool device tensor (fused optimizers' lazy flags). Cost: no host sync."""
        if self._pending and self._pending[-1][0] is result:
            return torch.remainder(self._pending[-1][1], 2 ** len(self.optimizers)) > 0
        return not result.applied

    def _fused_step(
        self,
        opt: torch.optim.Optimizer,
        found: torch.Tensor,
        unscaled: bool,
        kwargs: dict[str, Any],
    ) -> None:
        # The optimizer unscales inside its kernel (grad_scale) and skips itself on found_inf.
        assert self._scaler is not None
        opt.grad_scale = None if unscaled else self._scaler.scale_tensor  # type: ignore[attr-defined]
        opt.found_inf = found  # type: ignore[attr-defined]
        try:
            opt.step(**kwargs)
        finally:
            del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]

    def _clip(self, found: list[torch.Tensor] | None) -> torch.Tensor | None:
        if self.clip_grad_norm is None:
            return None
        grads = [p.grad for p in self._params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        safe = total
        if found is not None and len(found) > 1:
            # One optimizer's overflow must neither turn the others' gradients into NaN nor
            # leave them unclipped: they are clipped with the norm of the finite optimizers.
            safe = torch.where(torch.isfinite(total), total, self._finite_norm())
        torch.nn.utils.clip_grads_with_norm_(self._params, self.clip_grad_norm, safe)
        return total

    def _finite_norm(self) -> torch.Tensor:
        """Total grad norm over the optimizers whose own grads are finite. Cost: no sync."""
        sq = None
        for opt in self.optimizers:
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in _params_of(opt) if p.grad is not None]
            )
            norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
            sq = norm * norm if sq is None else sq + norm * norm
        assert sq is not None
        return sq.sqrt()

    def _remember_scale(self) -> None:
        assert self._scaler is not None
        self._history.record(self._steps, self._scaler.scale_tensor)

    def _contain_microbatch(self) -> None:
        if self._contain is None:
            self._contain = MicrobatchBuffer(self._params, self.accumulation_steps)
        dropped = self._contain.absorb(self._params)
        if self._micro_snapshot is not None:  # a dropped micro-batch's forward leaves no trace
            self._micro_snapshot.restore_where(self._micro_key(self._micro - 1), dropped)

    def _micro_key(self, micro: int) -> int:
        """A number unique to micro-batch ``micro`` of the window in progress."""
        return (self._steps + 1) * self.accumulation_steps + micro

    # ------------------------------------------------------------------ flags and collapse
    def _drain(self, act: bool = True) -> None:
        """Decode pending fused-step flags; unless ``act`` is False (a load replaces what they
        would count), also count them and act on a collapse. Cost: one host sync for all."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = torch.stack([status for _, status in pending]).tolist()
        collapsed, scaled, settled = [], self._scaler is not None, []
        for (result, _), value in zip(pending, values, strict=True):
            flags = result.settle(results.decode(int(value), len(self.optimizers), scaled))
            if not act:
                continue
            settled.append((result.step, flags))
            self._record(result.step, flags)  # count every step before any raise
            bound = _nonfinite.over_bound(self)  # bf16/fp32: too many non-finite skips in a row
            if (flags.collapse or bound) and self.scaler_config.on_collapse == "warn":
                self._on_collapse(result.step)  # in order: an applied step ends an episode
            elif flags.collapse or bound:  # the count as it was at that step, for the message
                collapsed.append((result.step, self._counts.consecutive_nonfinite))
        if collapsed:
            step, run = collapsed[0]
            self._on_collapse(step, run)
            if scaled and self._scaler is None:  # a fallback read late: its windows count
                _nonfinite.after_late_fallback(self, [sf for sf in settled if sf[0] > step])

    def _settle(self, step: int, flags: results.Decoded) -> None:
        self._record(step, flags)
        if flags.collapse or _nonfinite.over_bound(self):
            self._on_collapse(step)

    def _record(self, step: int, flags: results.Decoded) -> None:
        if self._forensics is not None:
            self._forensics.on_settled(step, flags.overflow or flags.nonfinite, flags.applied)
        self._counts.record(flags)
        if flags.applied:
            self._collapsing = False

    def _on_collapse(self, step: int, run: int | None = None) -> None:
        if self._scaler is None:  # no scale to lower: the bound on non-finite skips
            return _nonfinite.on_bound(self, step, run)
        policy = self.scaler_config.on_collapse
        if policy == "raise":
            raise ScaleCollapseError(
                self._collapse_message(step), verdict=_verdicts.verdict(self._forensics)
            )
        if policy == "warn":
            if not self._collapsing:
                warnings.warn(
                    self._collapse_message(step), RuntimeWarning, stacklevel=user_stacklevel()
                )
            self._collapsing = True
            return
        self._fall_back(step)

    def _collapse_message(self, step: int) -> str:
        hist = ", ".join(f"{s}: {v:g}" for s, v in self._history.tail(self._steps, 8))
        return (
            f"loss scale collapsed at step {step}: gradients overflow even at min_scale="
            f"{self.scaler_config.min_scale:g}; {self._counts.skipped} of "
            f"{count(self._steps, 'step')} "
            f"skipped. Scale history (step: scale): {hist}. "
            + (
                _verdicts.advice(self._forensics)  # what forensics concluded, if it did
                or "Try: precision='bf16' (same range as fp32); keep the overflowing module in "
                "fp32 (ampguard.locate names it); a lower learning rate; or "
                "ScalerConfig(on_collapse='fallback') to switch automatically."
            )
        )

    def _fall_back(self, step: int) -> None:
        target = "bf16" if supports_bf16(self._device.type) else "fp32"
        old = self._policy.precision
        self._policy = resolve_precision(target, self._device)
        if self._micro and self._scaler is not None:
            # acted on mid-window (a lazy fused flag read): the window's gradients so far carry
            # the old loss scale, the rest of the window will not
            grads = collect_grads(self._params)
            if self._contain is not None:
                grads += self._contain.buffers()
            self._scaler.unscale_(grads)
        self._scaler = None
        self._pending.clear()
        self._fallback = {"step": step, "from": old, "to": target}
        if self._telemetry is not None:
            self._telemetry.on_fallback(step, old, target)
        warnings.warn(
            f"loss scale collapsed at step {step}; ampguard switched precision {old} -> {target} "
            "(ScalerConfig.on_collapse='fallback') and continues without a loss scaler."
            + (f" {advice}" if (advice := _verdicts.advice(self._forensics)) else ""),
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    @property
    def fallback(self) -> dict[str, Any] | None:
        """``{"step", "from", "to"}`` if a collapse fallback switched precision, else None."""
        return self._fallback

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
        self._drain()
        c = self._counts
        history = self._history.tail(self._steps, last) if self._scaler is not None else []
        return {
            "step": self._steps,
            "precision": self._policy.precision,
            "scale": self.scale,
            "skipped_steps": c.skipped,
            "skipped_by_cause": {
                "overflow": c.skipped_overflow,
                "collapse": c.skipped_collapse,
                "nonfinite": c.skipped_nonfinite,
                "nonfinite_forward": c.skipped_nonfinite_loss,
            },
            "applied_steps": c.applied,
            "scale_changes": self._history.changes(),
            "last_scales": [{"step": s, "scale": v} for s, v in history],
            "consecutive_skips": c.consecutive_skips,
            "microbatches_dropped": c.dropped_microbatches,
            "fallbacks": self._fallbacks(),
            "resume": dict(self._resume.info) if self._resume.info else None,
            "resume_warmup_active": self._resume.ramp is not None,
        }

    def _fallbacks(self) -> list[dict[str, Any]]:
        changes = self._forensics.changes if self._forensics is not None else []
        if self._fp8 is not None and self._fp8.rescue is not None:  # fp8 -> bf16 rescues
            changes = [*changes, *self._fp8.rescue.changes]
        return ([dict(self._fallback)] if self._fallback else []) + [dict(c) for c in changes]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bitwise, as plain tensors/numbers/strings.

        Loads under ``torch.load(weights_only=True)``. Save at a window boundary (after
        ``step()`` applied or skipped): gradients of a half-finished window are not saved.
        Cost: one host sync.
        """
        self._drain()
        if self._telemetry is not None:  # a full run-log disk never fails a checkpoint
            self._telemetry.flush_deferred()
        if self._micro:
            warnings.warn(
                f"Guard.state_dict() called mid-window ({self._micro} of "
                f"{self.accumulation_steps} micro-batches); their gradients are not saved",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return {
            "version": _STATE_VERSION,
            "precision": self._policy.precision,
            "requested_precision": self._requested_precision,
            "fallback": dict(self._fallback) if self._fallback else None,
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "scaler_config": self.scaler_config.to_dict(),
            "steps": self._steps,
            "accumulation_steps": self.accumulation_steps,
            "counters": self._counts.to_dict(),
            "scale_history": self._history.state_dict(),
            "resume": self._resume.state_dict(),
            "forensics": self._forensics.state() if self._forensics is not None else None,
            "fp8": self._fp8.state() if self._fp8 is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict`` output; raises ``ValueError`` on a malformed state.

        All or nothing: the whole state is checked before anything is set, so a load that
        raises leaves this Guard exactly as it was. The precision given to this Guard's
        constructor wins over the saved one, except that a recorded automatic fallback from
        that same precision is resumed; both cases warn.
        """
        _guard_state.apply(self, _guard_state.check(self, state))

    def _mark_resume(self, *, scale_reset: bool, saved_scale: float | None = None) -> None:
        # telemetry continues the run log (and the step count, for a checkpoint without Guard
        # state) and returns the scale the run had before the interruption
        previous = None
        if self._telemetry is not None:
            resumed = self._telemetry.on_resume(self._steps, scale_reset, saved_scale)
            self._steps, previous = resumed.step, resumed.previous_scale
        self._resume.mark(self._steps, scale_reset=scale_reset, saved_scale=saved_scale)
        if previous is not None:
            self.check_resume(previous)

    def check_resume(self, previous_scale: float) -> float | None:
        """Compare the resumed scale with the one the run had right before the interruption.

        ``previous_scale`` comes from the run log (telemetry passes it on resume). Returns the gap
        in powers of two; starts the ``resume_warmup`` ramp when the gap is large.
        Cost: one host sync.
        """
        current = self.scale if self._scaler is not None else None
        return self._resume.check(self._steps, previous_scale, current)

    # ------------------------------------------------------------------ telemetry
    @property
    def telemetry(self) -> Telemetry | None:
        """The attached ``ampguard.Telemetry`` (``telemetry=`` argument), or None."""
        return self._telemetry

    @property
    def stagnation(self) -> StagnationProbe | None:
        """The probe measuring, per layer, the share of updates that round away in bf16/fp16
        weights (``.shares()``, ``.stagnant()``: one host sync each; AG175 in ``findings()``),
        or None when every trained parameter is fp32."""
        return self._stagnation

    @property
    def coverage(self) -> Any:
        """The ``ampguard.Coverage`` of window ``coverage_step`` once it ran, else None."""
        return self._forensics.coverage if self._forensics is not None else None

    def findings(self) -> list[Finding]:
        """The AG1xx findings over the run so far (needs ``telemetry=``), plus the AG3xx
        diagnoses, fallbacks and coverage of ``forensics``/``auto_fallback``/``coverage_step``
        (those work without telemetry too: then only they are returned, never an error; with
        none of them enabled, an empty list and a warning that says why).

        Also writes ``findings.json`` to the run folder. Cost: one host sync (the telemetry
        flush) and a read of the run log.
        """
        side = self._side_findings()
        if self._telemetry is None:  # what forensics/fp8/distributed found; no rules to run
            if (
                self._forensics is None
                and self._dist is None
                and self._fp8 is None
                and self._stagnation is None
            ):
                warnings.warn(
                    "Guard.findings(): without telemetry only forensics, fp8 and distributed "
                    "findings exist (none are enabled); the AG1xx rules need a run log: create "
                    "the Guard with telemetry=RUN_DIR (or an ampguard.Telemetry)",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
            return side
        self._telemetry.record_findings(side)
        return self._telemetry.findings()

    def _side_findings(self) -> list[Finding]:
        """Findings made during the run (forensics AG3xx, distributed AG13x), not by the rules."""
        out = self._forensics.findings() if self._forensics is not None else []
        if self._stagnation is not None:  # AG175: bf16/fp16 weights whose updates round away
            out += self._stagnation.findings()
        if self._fp8 is not None:  # AG111/AG112: fp8 layers drifting out of fp8's window
            out += self._fp8.findings()
        if self._dist is not None:
            out += self._dist.findings(self._steps)
        return out

    def close(self) -> None:
        """Flush telemetry, write ``findings.json``, close the run log and write ``report.html``
        (no-op without telemetry; idempotent; without matplotlib the report is a one-line
        warning). Cost: one host sync; rendering the report takes about a second."""
        if self._telemetry is not None and not self._telemetry.closed:
            try:  # a collapse surfacing here (pending fused flags) still closes the run log
                self._telemetry.record_findings(self._side_findings())
                self._telemetry.annotate("diagnostics", self.diagnostics())  # report header
                if self._dist is not None:
                    self._telemetry.annotate("distributed", self._dist.summary())
            finally:
                self._telemetry.close()
            _write_report(self._telemetry.run_dir)  # as the framework integrations do

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

    def _make_scaler(self) -> LossScaler | None:
        if not self._policy.needs_scaler:
            return None
        return LossScaler(self.scaler_config, self._device)

    # ------------------------------------------------------------------ distributed
    @property
    def distributed(self) -> DistributedState | None:
        """The ``DistributedState`` (topology, per-rank counters,
        audit), or None when training in one process."""
        return self._dist

    def audit(self) -> dict[str, dict[int, Any]]:
        """Run the cross-rank audit now (every rank must call it); ``{}`` when in sync or not
        distributed. Cost: one host sync and one small all-reduce."""
        return self._dist.audit(self, reason="requested") if self._dist is not None else {}

    def _peers(self, what: str, step: int | None = None) -> contextlib.AbstractContextManager:
        """A failed collective in the block -> ``PeerFailureError`` naming the ranks; ``step``:
        the window (default: the one in progress)."""
        if self._dist is None:
            return contextlib.nullcontext()
        return self._dist.collectives(what, self._steps + 1 if step is None else step)

    def _grad_sync_context(self) -> contextlib.AbstractContextManager:
        final = self._micro >= self.accumulation_steps - 1
        if self._dist is not None:
            return self._dist.grad_sync_context(final, self.contain_nonfinite_microbatches)
        no_sync = getattr(self.model, "no_sync", None)
        if final or no_sync is None or not _is_ddp(self.model):
            return contextlib.nullcontext()
        return no_sync()

    # ------------------------------------------------------------------ for ampguard's own modules
    # The Guard's surface for the modules that act on a Guard from outside this class (the
    # checkpoint loader, the cross-rank audit, forensics, StepResult): they use these, never
    # the Guard's private attributes (issue 14; tests/test_privates.py checks it).
    def settle_pending(self) -> None:
        """Decode, count and act on the pending step flags of fused optimizers (what reading
        ``StepResult.applied`` or ``skipped_steps`` does). Cost: one host sync for all
        pending windows; none when nothing is pending."""
        self._drain()

    @property
    def applied_steps(self) -> int:
        """Windows whose step was applied, as counted so far: pending fused-optimizer flags are
        not settled (read ``skipped_steps`` first for settled totals). Cost: no host sync."""
        return self._counts.applied

    def scale_used_at(self, step: int) -> float:
        """The loss scale window ``step`` ran with (one of the last 32 windows: the scale history);
        1.0 without a loss scaler. Cost: one host sync with a scaler, none without."""
        if self._scaler is None:
            return 1.0
        return self._history.used_at(step)

    def scaler_state(self) -> dict[str, Any] | None:
        """The loss scaler's ``state_dict()`` (``scale``, ``growth_tracker``,
        ``hysteresis_tracker``...), or None without a scaler (bf16, fp32, after a fallback).
        Cost: one host sync with a scaler."""
        return None if self._scaler is None else self._scaler.state_dict()

    def restore_counts(
        self, *, steps: int, applied: int, skipped: int, scaler_state: dict[str, Any] | None = None
    ) -> None:
        """Set the window counters (and, with a scaler, its state) to another rank's: the
        audit's repair (``on_desync="repair"``). ``scaler_state`` is ignored without a scaler.
        Cost: no host sync."""
        if self._scaler is not None and scaler_state is not None:
            self._scaler.load_state_dict(scaler_state)
        self._steps = steps
        self._counts.applied = applied
        self._counts.skipped = skipped

    def restart_scale(self) -> None:
        """A checkpoint without scaler state: the scale starts again from ``init_scale`` (a
        resume is recorded, see ``resume``). Cost: none beyond the resume check."""
        if self._scaler is not None:
            self._scaler = self._make_scaler()
            self._history.reset(self.scaler_config.init_scale)
        self._mark_resume(scale_reset=self._scaler is not None)

    def adopt_torch_scaler_state(self, state: dict[str, Any]) -> None:
        """Take over a ``torch.amp.GradScaler.state_dict()`` (scale and growth tracker; torch
        names the tracker ``_growth_tracker`` in that dict). Needs a loss scaler."""
        assert self._scaler is not None
        self._scaler.load_state_dict(
            {"scale": state["scale"], "growth_tracker": state.get("_growth_tracker", 0)}
        )
        self._history.reset(float(state["scale"]))  # not init_scale: no spurious scale change
        self._mark_resume(scale_reset=False, saved_scale=float(state["scale"]))


# ---------------------------------------------------------------------- helpers
def _is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)
