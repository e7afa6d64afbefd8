"""The :class:`Telemetry` recorder (producer hooks, sampling, flush) and its attach.

What it records and when is described in :mod:`ampguard.telemetry` (the package docstring); the
records a step leaves behind until the flush are the named records of
:mod:`ampguard.telemetry._rows`; the run folder (its lock, log, ``meta.json``, sinks and the
write-error policy) is the :class:`~ampguard.telemetry._run_writer.RunWriter` it drives.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ampguard import runlog
from ampguard._util.cadence import early_or_every
from ampguard._util.checks import check_bool, check_int
from ampguard.findings import Finding
from ampguard.telemetry import _layers
from ampguard.telemetry._absorbed import counter_for_run
from ampguard.telemetry._device import DeviceBuffer, host_view
from ampguard.telemetry._range_sample import RangeSampler
from ampguard.telemetry._records import Facts, RunTally, Shape, build_lines
from ampguard.telemetry._rows import NO_SAMPLE, Resumed, Sample, StepRow
from ampguard.telemetry._run_writer import RunWriter
from ampguard.telemetry._staging import HostStaging
from ampguard.telemetry.source import TelemetrySource

TelemetryError = runlog.TelemetryError  # public: ag.TelemetryError (defined torch-free in runlog)

__all__ = ["DENSE_LAYER_STEPS", "Telemetry", "TelemetryError", "attach", "check_argument"]


DENSE_LAYER_STEPS = 32
"""With the default ``layer_every`` (None), steps 1..32 of a run sample the gradient norms every
step and later steps every 10th: a short run (a smoke test, a 20-step repro) gets a heatmap with
a column per step, for 29 extra samples in all. An explicit ``layer_every`` is kept exactly."""


class Telemetry:
    """Records what a :class:`ampguard.Guard` does into ``run_dir``, without per-step host syncs.

    The producer (a Guard, or :func:`ampguard.watch`) is a :class:`TelemetrySource` that calls
    the ``on_*`` hooks (see :mod:`ampguard.telemetry.source` for the whole contract).

    Arguments: ``flush_every`` (rows in the device ring buffer; one device-to-host transfer per
    flush), ``layer_stats`` (per-layer grad norms; False keeps only the total norm),
    ``layer_every`` (gradient statistics every N steps; 1 = every step; None, the default:
    every 10 steps and each of the first ``DENSE_LAYER_STEPS`` = 32), ``range_every``
    (fp16 range statistics every N steps; 0 = off), ``tensorboard`` (also write ``tb/`` with the
    ``tensorboard`` package), ``resume`` (continue an existing log in ``run_dir`` and mark the
    resume point; False starts the log over), ``sinks`` (extra sinks such as
    :class:`ampguard.integrations.sinks.WandbSink`: objects with ``start(run_dir, layers)``,
    ``write(records, skip_rate)`` and ``close()``, called at attach, at every flush and on close),
    ``absorbed`` (on the range-sampled windows, count per module the fp16/bf16 ops of the forward
    that made inf/NaN from finite inputs: absorbed overflow, AG170; False turns it off, e.g. for
    a model whose forward must not run under a ``TorchDispatchMode``);
    ``on_write_error`` (a write to the run folder that fails, e.g. a full disk: ``"warn"``
    suspends telemetry with one warning and training goes on, ``"raise"`` raises
    :class:`TelemetryError` before the next update; see :mod:`ampguard.telemetry._disk`).

    The run folder has one writer at a time: attaching takes its lock (``.ampguard.lock``, with
    the pid; see :mod:`ampguard.runlog._lock`) and :meth:`close` releases it. A folder that
    cannot be created or written, or that another writer holds, is a :class:`TelemetryError`
    naming it when the Guard is built.

    Cost: no host sync between flushes. Per step: no device op on the CPU, one tiny copy (the
    scale) on a device, and a detached reference to each micro-batch's loss; on statistics steps
    one multi-tensor norm (its per-tensor results are kept and stacked at the flush); on range
    steps about 15 ops, mostly integer ops on the fp32 bits of the flattened gradients, in chunks
    of 2**20 elements, and the window's forward passes watched op by op (about four small device
    ops per fp16 op, :mod:`ampguard.telemetry._absorbed`). A flush is one stack of the kept
    tensors and one device-to-host copy: on CUDA into pinned memory without a host sync, its
    records written at the next flush (so the cheap reads lag one flush on CUDA);
    :meth:`flush`, :meth:`findings` and :meth:`close` wait for it (one sync). Producers may skip
    :meth:`on_grads` while the step is below :attr:`next_sample`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        flush_every: int = 100,
        layer_stats: bool = True,
        layer_every: int | None = None,
        range_every: int = 100,
        tensorboard: bool = False,
        *,
        resume: bool = True,
        sinks: Any = (),
        on_write_error: str = "warn",
        absorbed: bool = True,
    ) -> None:
        if not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(
                f"Telemetry run_dir must be a path (str or os.PathLike), got "
                f"{type(run_dir).__name__}"
            )
        for name, value in (
            ("layer_stats", layer_stats),
            ("tensorboard", tensorboard),
            ("resume", resume),
            ("absorbed", absorbed),
        ):
            check_bool(f"Telemetry {name}", value)
        self.run_dir = Path(run_dir)
        self.flush_every = check_int("Telemetry flush_every", flush_every)
        # None: every 10 steps, and each of the first DENSE_LAYER_STEPS (a short run's heatmap)
        self._dense = DENSE_LAYER_STEPS if layer_every is None else 0
        every = 10 if layer_every is None else layer_every
        self.layer_every = check_int("Telemetry layer_every", every)
        self.range_every = check_int("Telemetry range_every", range_every, 0)
        self.layer_stats, self.tensorboard, self.resume = layer_stats, tensorboard, resume
        # the run folder, its log and sinks, and the write-error policy (on_write_error)
        self._writer = RunWriter(
            self.run_dir, on_write_error, resume=resume, tensorboard=tensorboard, sinks=sinks
        )
        self.on_write_error = on_write_error
        self.sinks = self._writer.sinks  # extra sinks (ampguard.integrations.sinks)
        self.absorbed = absorbed
        # the first step whose gradients are sampled: a producer may skip on_grads before it
        self.next_sample = self._due_after(0)
        self._source: TelemetrySource | None = None
        self._closed = False
        self.flushes = 0

    @property
    def flush_due(self) -> bool:
        """True while a write waits for :meth:`before_update` (``on_write_error="raise"``: a full
        buffer, or lines whose write failed). Cost: none."""
        return self._writer.flush_due

    @flush_due.setter
    def flush_due(self, value: bool) -> None:
        self._writer.flush_due = value

    def config(self) -> dict[str, Any]:
        """The constructor arguments as a plain dict (recorded in ``meta.json``)."""
        return {
            "flush_every": self.flush_every,
            "layer_stats": self.layer_stats,
            "layer_every": self.layer_every,
            "range_every": self.range_every,
            "tensorboard": self.tensorboard,
            "on_write_error": self.on_write_error,
            "absorbed": self.absorbed,
        }

    # ------------------------------------------------------------------ attach and layout
    def _attach(self, source: TelemetrySource) -> None:
        if self._source is not None:
            raise ValueError("this Telemetry is already attached to a Guard; use one per Guard")
        self._source = source
        try:
            self._attach_to(source)
        except BaseException:
            self._source = None
            raise

    def _attach_to(self, source: TelemetrySource) -> None:
        self._device = source.device
        self._n_optimizers = len(source.optimizers)
        layout = _layers.build_layout(source.model, source.params)
        self._layout = layout
        self.layers = layout.names
        n_layers = len(layout.names)
        self._sharded = any(hasattr(p, "to_local") for p in layout.params)
        self._ranger = RangeSampler(layout, self._device) if self.range_every else None
        self._cells = DeviceBuffer(
            self.flush_every,
            len(layout.params),
            n_layers,
            1 if self._dense else self.layer_every,  # slots for the dense first steps too
            self.range_every,
            self._device,
        )
        ends = np.flatnonzero(np.diff(layout.layer_of, append=-1)) + 1  # tensors in layer order
        starts = [0, *ends[:-1].tolist()][: len(ends)]  # none under ZeRO-3's flat partitions
        self._shape = Shape(
            self._n_optimizers,
            tuple(zip(starts, ends.tolist(), strict=True)),
            self.layer_stats,
        )
        self._zero = torch.zeros((), dtype=torch.float32, device=self._device)
        self._stage = HostStaging(self._cells.flat.numel(), self._device)
        # one StepRow per recorded step, and every recorded micro-batch's loss, in order
        self._pending: list[StepRow] = []
        self._losses: list[torch.Tensor] = []
        self._micro = self._stats_used = self._ranges_used = 0
        self._this_step: Sample = NO_SAMPLE
        self._read_source()
        self._scale_tensor: torch.Tensor | None = None  # the scaler's live tensor last seen
        self._scale_view: memoryview[float] | None = None  # its value in host memory (CPU only)
        self._scale_carry = (
            float(source.scaler_config.init_scale) if source.loss_scaler is not None else 1.0
        )
        self._tally = RunTally(source.accumulation_steps)
        meta = _layers.run_meta(source, layout, self.config())
        self._writer.open(meta, self.layers)
        self._absorbed = (  # AG170 (after open: a failed open leaves no hook)
            counter_for_run(source.model, self._device, self.flush_every, self.range_every)
            if self.range_every and self.absorbed
            else None
        )

    def _read_source(self) -> None:
        """Take the source's precision and loss scaler (at attach, on_fallback and on_resume)."""
        assert self._source is not None
        self._precision, self._scaler = self._source.precision, self._source.loss_scaler

    # ------------------------------------------------------------------ producer hooks (hot path)
    # The producer side of the contract (ampguard.telemetry.source): a Guard or a Watch calls
    # on_backward per micro-batch, then on_grads and on_step (or on_abort) once per window.
    def on_backward(self, loss: torch.Tensor) -> None:
        """A micro-batch's (unscaled, undivided) loss: summed over the window at the flush.
        Cost: no device op (a detached reference is kept)."""
        if self._closed:
            return
        self._losses.append(loss.data)  # detach()'s alias without its bookkeeping: ~1 us less
        self._micro += 1

    def on_grads(self, step: int, grads_scaled: bool) -> None:
        """Gradients of window ``step`` (1-based) are final (unscaled unless ``grads_scaled``,
        then ``loss_scaler.inv_scale()`` unscales the range sample). Called at most once per
        window before :meth:`on_step` (a repeat re-samples); a producer may skip the call while
        ``step < next_sample`` (nothing is sampled then). Cost: no host sync; device work only
        on statistics steps."""
        if self._closed:
            return
        if self._writer.pending:  # the first step came without a resume: a new run
            self._writer.begin()
        layers = step % self.layer_every == 0 or step <= self._dense
        ranged = self.range_every and step % self.range_every == 0
        if not (layers or ranged):
            return
        self._sample(layers, bool(ranged), grads_scaled)

    def _sample(self, layers: bool, ranged: bool, grads_scaled: bool) -> None:
        stats_slot, range_slot, _ = self._this_step  # a re-sample of this window reuses them
        cells = self._cells
        if (layers and stats_slot < 0 and self._stats_used == cells.stats_slots) or (
            ranged and range_slot < 0 and self._ranges_used == cells.range_slots
        ):
            self._flush(wait=False)  # every slot taken (a safety net: they are sized for this)
            stats_slot, range_slot, _ = self._this_step
        grads = self._grads()
        if not grads:  # no gradient tensor to sample (ZeRO-3 partitions them away)
            return
        if layers:
            if stats_slot < 0:
                stats_slot, self._stats_used = self._stats_used, self._stats_used + 1
            # one multi-tensor norm; the flush stacks every sample's norms into the buffer
            cells.hold_norms(stats_slot, torch._foreach_norm(grads))
        if ranged:
            if range_slot < 0:
                range_slot, self._ranges_used = self._ranges_used, self._ranges_used + 1
            self._range_stats(grads, range_slot, grads_scaled)
        self._this_step = Sample(stats_slot, range_slot, grads_scaled)

    def on_step(
        self, step: int, status: torch.Tensor | int | None, grad_norm: torch.Tensor | None
    ) -> None:
        """Window ``step``'s optimizer step and scale update are done (``status``: the packed
        flags of :func:`ampguard.core.results.pack`, as the device tensor or, where the producer
        has read them, as an int; None: all applied; ``grad_norm``: the unscaled total norm the
        producer computed, or None). Cost: on the CPU no device op (the scale is read from host
        memory), elsewhere one (its copy); no host sync."""
        if self._closed:
            return
        if self._writer.pending:  # no gradient sample opened the log yet: this is a new run
            self._writer.begin()
        if self.flush_due:  # raise mode, a producer that does not call before_update()
            self._flush(wait=False)
        pending = self._pending
        scaler = self._scaler
        scale = None
        if scaler is not None:  # updated in place by the next step: take its value now
            tensor = scaler.scale_tensor
            if tensor is not self._scale_tensor:
                self._scale_tensor, self._scale_view = tensor, host_view(tensor)
            if self._scale_view is not None:  # CPU: read from host memory, no torch op
                scale = self._scale_view[0]
            else:  # a device: the step's one device op
                self._cells.scale_cells[len(pending)].copy_(tensor)
        # the flags, loss and norm are new tensors of this step: gathered at the flush
        pending.append(StepRow(step, self._micro, scale, self._this_step, status, grad_norm))
        self._this_step = NO_SAMPLE
        self._micro = 0
        absorbed = self._absorbed
        if absorbed is not None and (
            absorbed.armed_step is not None or early_or_every(step + 1, self.range_every)
        ):
            absorbed.disarm()
            if early_or_every(step + 1, self.range_every):
                absorbed.arm(step + 1)
        if step >= self.next_sample:
            self.next_sample = self._due_after(step)
        if len(pending) == self.flush_every:
            if self._writer.failures.mode == "raise":  # written before the next update (a Guard)
                self.flush_due = True
            else:
                self._flush(wait=False)

    def before_update(self) -> None:
        """The producer is about to apply a window's update: write the full buffer now, so that
        with ``on_write_error="raise"`` a failed write raises :class:`TelemetryError` before
        the update (the Guard calls this at the start of ``step()`` while :attr:`flush_due`).
        Cost: a flush (as the automatic one)."""
        if self.flush_due:
            self._flush(wait=False)

    def _due_after(self, step: int) -> int:
        """The first step after ``step`` whose gradients are sampled."""
        if step < self._dense:  # a short run's heatmap: every one of the first steps
            return step + 1
        return min(step // k * k + k for k in (self.layer_every, self.range_every) if k)

    def on_abort(self) -> None:
        """The window in progress ended without a step (an exception inside ``Guard.step``, or a
        load mid-window): forget its loss and gradient statistics. Cost: no host sync."""
        if self._closed or self._source is None:
            return
        if self._micro:
            del self._losses[-self._micro :]
        stats_slot, range_slot, _ = self._this_step
        absorbed = self._absorbed
        if absorbed is not None and absorbed.armed_step is not None:  # the window runs again
            window = absorbed.armed_step
            absorbed.forget()
            absorbed.arm(window)
        if stats_slot >= 0:
            self._cells.drop_norms(stats_slot)
        if stats_slot >= 0 and stats_slot == self._stats_used - 1:
            self._stats_used -= 1
        if range_slot >= 0 and range_slot == self._ranges_used - 1:
            self._ranges_used -= 1
        self._micro = 0
        self._this_step = NO_SAMPLE

    def _grads(self) -> list[torch.Tensor]:
        if self._sharded:  # FSDP2: statistics of this rank's gradient shards
            return [
                self._zero.expand(_layers.local(p).shape)
                if p.grad is None
                else _layers.local(p.grad)
                for p in self._layout.params
            ]
        out: list[Any] = [p.grad for p in self._layout.params]
        for i, g in enumerate(out):
            if g is None or g.is_sparse:
                out[i] = (  # no grad: all zeros
                    self._zero.expand(self._layout.params[i].shape) if g is None else g.to_dense()
                )
        return out

    def _range_stats(self, grads: list[torch.Tensor], slot: int, grads_scaled: bool) -> None:
        row, amax, hist = self._cells.ranges[slot]
        row.zero_()
        scaler = self._scaler if grads_scaled else None
        assert self._ranger is not None
        self._ranger.sample(grads, amax, hist, scaler.inv_scale() if scaler is not None else None)

    # ------------------------------------------------------------------ resume and events
    def on_resume(self, step: int, scale_reset: bool, saved_scale: float | None) -> Resumed:
        """The producer resumed from a checkpoint at step count ``step``: continue the run log
        and mark the resume point.

        Returns :class:`Resumed`: the step count to continue from (``step``, or, for a checkpoint
        without Guard state, ``step == 0``, the last step in the log: the producer adopts it) and
        the loss scale the run had at that step before the interruption (from the log), or
        None. Cost: flushes.
        """
        if self._closed or self._source is None:
            return Resumed(step, None)
        self.flush()
        self._read_source()  # a load may change the precision or replace the scaler
        source = self._source
        step = self._writer.continue_log(step)
        if source.loss_scaler is None:
            scale = 1.0
        else:
            scale = (
                source.scaler_config.init_scale
                if scale_reset or saved_scale is None
                else float(saved_scale)
            )
        self._scale_carry = scale
        self.next_sample = self._due_after(step)
        if self._absorbed is not None:
            self._absorbed.forget()
            if not (step + 1) % self.range_every:
                self._absorbed.arm(step + 1)
        return Resumed(step, self._writer.mark_resume(step, scale, scale_reset))

    def on_fallback(self, step: int, old: str, new: str) -> None:
        """The producer switched precision ``old`` -> ``new`` at ``step`` (a collapse fallback;
        its ``loss_scaler`` is None from now on). Cost: flushes (one sync)."""
        if self._closed:
            return
        self.flush()
        self._read_source()
        self._writer.append_events([{"kind": "fallback", "step": step, "from": old, "to": new}])

    def append_events(self, records: list[dict[str, Any]]) -> None:
        """Append non-step records (e.g. ``{"kind": "fp8", ...}``) to the run log after the steps
        recorded so far. Nothing is written before the log has started or after close.
        Cost: flushes (one sync)."""
        if self._closed:
            return
        self.flush()
        self._writer.append_events(records)

    # ------------------------------------------------------------------ flush
    def flush(self) -> None:
        """Write every recorded step to the run folder.

        Cost: one device-to-host copy, and a host sync on CUDA (waiting for it). The automatic
        flush every ``flush_every`` steps does not wait: on CUDA it copies into pinned host
        memory without blocking and its records are written at the next flush (or close).
        """
        self._flush(wait=True)

    def flush_deferred(self) -> None:
        """:meth:`flush`, except that a failed write never raises here: with
        ``on_write_error="raise"`` its records are kept and the error is raised by the next
        ``step()``, :meth:`flush` or :meth:`close` (``Guard.state_dict()`` uses it, so a
        checkpoint never fails for the run log's disk). Cost: as :meth:`flush`."""
        try:
            self.flush()
        except TelemetryError:
            self.flush_due = True

    def _flush(self, wait: bool) -> None:
        if self._source is None or self._closed:
            return
        self.flush_due = False
        if self._stage.in_flight:  # earlier copies that completed (CUDA); frees a host buffer
            self._write_ready(wait=False)
        pending, self._pending = self._pending, []
        if pending:
            steps, micro, scale, samples, statuses, norms = zip(*pending, strict=True)
            stats_slots, range_slots, sampled_scaled = zip(*samples, strict=True)
            rows = len(pending)  # a fallback or resume flushes first: one precision per flush
            facts = Facts(
                steps,
                micro,
                (self._scaler is not None,) * rows,
                scale,
                stats_slots,
                range_slots,
                sampled_scaled,
                (self._precision,) * rows,
                tuple(None if isinstance(s, torch.Tensor) else s or 0 for s in statuses),
                tuple(g is not None for g in norms),
            )
            used = sum(facts.micro)
            losses, self._losses = self._losses[:used], self._losses[used:]
            # with the kept gradient norms (also those of a window in progress: carried below)
            self._cells.gather(statuses, norms, losses, facts.micro)
            counts = (self._stats_used, self._ranges_used)
            self._stage.push(self._cells.used(*counts), (facts, counts))  # the one transfer
        if self._absorbed is not None:  # the sampled windows' counters: their own copy
            self._absorbed.push()
        # the window in progress (gradients sampled, no step yet) keeps its samples in slot 0
        stats_slot, range_slot, grads_scaled = self._this_step
        stats_slot, range_slot = self._cells.carry(stats_slot, range_slot)
        self._stats_used, self._ranges_used = int(stats_slot >= 0), int(range_slot >= 0)
        self._this_step = Sample(stats_slot, range_slot, grads_scaled)
        self._write_ready(wait=wait)

    def _write_ready(self, wait: bool) -> None:
        """Write the records of every completed copy (all of them with ``wait``)."""
        tried = False
        for host, (facts, counts) in self._stage.ready(wait):
            tried = True
            values = self._cells.host_values(host, *counts)
            lines, outcome, self._scale_carry = build_lines(
                facts, values, carry=self._scale_carry, shape=self._shape
            )
            written = self._writer.write(lines, tuple(facts.step))
            sinks = self._writer.has_sinks
            rates = self._tally.add(outcome, rates=sinks)
            if sinks and written:
                self._writer.to_sinks(lines, rates)
            self.flushes += 1
        if self._absorbed is not None:
            absorbed = self._absorbed.records(wait)
            if absorbed:
                self._writer.append(absorbed)
        if not tried:  # what failed at an earlier flush, again
            self._writer.retry()
        self._writer.raise_error()

    @property
    def unrecorded(self) -> dict[str, Any]:
        """What a full or read-only disk kept out of the run log: ``gaps`` (each with its first
        ``step``, ``last`` step, ``records``, ``reason``), ``records`` and ``events`` (counts),
        and ``suspended`` (True while writes fail). Cost: none."""
        return self._writer.unrecorded()

    # ------------------------------------------------------------------ cheap accessors
    def recent_scales(self, k: int = 32) -> list[tuple[int, float | None]]:
        """The last ``k`` (step, scale after the step) pairs up to the last flush. No sync."""
        return self._tally.recent_scales(k)

    def skip_counts(self) -> dict[str, int]:
        """Skipped steps by cause (``overflow``, ``dropped_microbatches``, ``collapse``) up to the
        last flush. No sync."""
        return dict(self._tally.skips)

    def summary(self) -> dict[str, Any]:
        """Running totals up to the last flush (steps, scale changes, consecutive skips now,
        micro-batches dropped, skips by cause, last scales). No sync."""
        return self._tally.summary()

    # ------------------------------------------------------------------ findings and close
    def findings(self) -> list[Finding]:
        """Flush, evaluate the AG1xx rules over the whole run log, write ``findings.json``; after
        :meth:`close`, the findings close wrote (nothing is written again). Cost: one sync (the
        flush) and a read of the run log; none after close (or one read of ``findings.json``)."""
        if self._closed:
            return self._writer.final_findings()
        self.flush()
        return self._writer.findings()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def annotate(self, key: str, value: Any) -> None:
        """Add a JSON-ready ``value`` under ``key`` to ``meta.json`` (written at close)."""
        self._writer.meta[key] = value

    def record_findings(self, found: list[Finding]) -> None:
        """Record findings made during the run (not by the rules) in the run log, so that
        ``findings.json`` and the report include them. Cost: one sync (the flush)."""
        fresh = self._writer.fresh(found)
        if not fresh or self._closed:
            return
        self.flush()
        self._writer.record_findings(fresh)

    def close(self) -> None:
        """Flush, write ``findings.json``, close the sinks and release the run folder.
        Idempotent. A write that fails here follows ``on_write_error`` (a warning, or one
        :class:`TelemetryError`), never a bare ``OSError``. Cost: one sync."""
        if self._source is None or self._closed:
            self._closed = True
            return
        error: TelemetryError | None = None
        try:
            self.findings()
        except TelemetryError as exc:
            error = exc
        finally:
            self._closed = True
            error = self._writer.close(error)  # sinks, log, meta.json's end, the lock
        if error is not None:
            raise error

    def release(self) -> None:
        """Give the run folder up without writing anything more: close the log file, release
        the lock and detach (a Guard whose constructor failed calls it). Idempotent; never
        raises. :meth:`close` calls it last."""
        self._writer.release(abandon=not self._closed)
        if not self._closed:
            self._source = None


def check_argument(telemetry: Any) -> None:
    """``TypeError`` unless ``telemetry`` is None, a run folder path or a Telemetry (a Guard
    checks it before it changes anything)."""
    if telemetry is not None and not isinstance(telemetry, (str, os.PathLike, Telemetry)):
        raise TypeError(
            "telemetry must be None, a run folder path or an ampguard.Telemetry, got "
            f"{type(telemetry).__name__}"
        )


def attach(telemetry: Any, source: TelemetrySource) -> Telemetry | None:
    """Resolve a Guard's ``telemetry=`` argument (None, a run folder, or a Telemetry) and attach
    it to ``source`` (the Guard, or a watched loop)."""
    if telemetry is None:
        return None
    if isinstance(telemetry, (str, os.PathLike)):
        telemetry = Telemetry(telemetry)
    elif not isinstance(telemetry, Telemetry):
        raise TypeError(
            "telemetry must be None, a run folder path or an ampguard.Telemetry, got "
            f"{type(telemetry).__name__}"
        )
    telemetry._attach(source)
    return telemetry


Telemetry.__module__ = "ampguard.telemetry"  # its public home: repr and pickles name that path
