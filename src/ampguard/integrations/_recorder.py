"""Attach mode's flight recorder and loss-spike policy: the Guard's, on a loop ampguard watches.

One implementation: :class:`AttachRecorder` holds the Guard's own
:class:`ampguard.guard.SpikeWatch` (the device ring buffer, the sync-free
:class:`ampguard.replay.SpikeDetector`, the dumps into the run folder, AG180) and feeds it from
the seam's events instead of ``Guard.step()``. Per optimizer step (a *window*), all on the
device and without a host sync:

* the losses handed to the watch (``scaler.scale``, ``record_loss``, ``engine.backward``) are
  collected; when the gradients are final (the scaler's unscale, the optimizer's step, the end of
  the window's backward) the window *begins*: its mean loss goes to the detector and the ring,
  with the LR of every param group and the per-parameter gradient norms (unscaled, before any
  clipping);
* the spike flag is added to the step's packed flags (``StepResult``'s bits, so the run log
  counts a skipped spike as ``loss_spike``), and the loss scale and sampled update-to-weight
  ratios go to the ring;
* the flags are read on the host lazily, with the telemetry's flush (every ``flush_every``
  steps), ``findings()`` and ``close()``: then each spike warns or is recorded (AG180) and the
  ring is dumped into ``RUN_DIR/flight_recorder/rank<R>.json`` (also on non-finite gradients,
  an exception the framework reports, and SIGTERM), so ``ampguard postmortem RUN_DIR`` reads an
  attached run as a Guard's.

What ``on_spike="skip"`` can do depends on who owns the optimizer step; see
:data:`ampguard.integrations._skip` and ``docs/integrations.md``. ``"rewind"`` is accepted (and
checked) as the Guard does, but attach mode cannot rewind: the framework owns the data order and
the LR schedule, so a spiked step is skipped instead, and attach says so once.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch

from ampguard._util.stack import user_stacklevel
from ampguard.core import results
from ampguard.findings import Finding
from ampguard.guard import (
    DEFAULT_CAPACITY,
    DEFAULT_SNAPSHOT_EVERY,
    SpikeConfig,
    SpikeWatch,
    attach_flight_recorder,
    check_flight_recorder,
    check_signatures,
)
from ampguard.replay import FlightRecorder

__all__ = ["AttachRecorder", "RecorderOptions", "spike_config"]


@dataclass(frozen=True)
class RecorderOptions:
    """What ``watch(flight_recorder=, on_spike=, snapshot_every=, signatures=)`` asked for
    (checked by :func:`spike_config` and ``ampguard.guard.check_signatures``)."""

    flight_recorder: Any = DEFAULT_CAPACITY
    on_spike: Any = "warn"
    snapshot_every: Any = None  # None: no snapshots (attach mode does not rewind)
    signatures: Any = False

    def validate(self) -> None:
        """The Guard's checks now (a callback made before its run): ``TypeError`` /
        ``ValueError`` naming the argument."""
        every = self.snapshot_every
        check_flight_recorder(
            self.flight_recorder,
            DEFAULT_SNAPSHOT_EVERY if every is None else every,
            every is not None or self.on_spike == "rewind",
            self.on_spike,
            [],
            [],
        )
        check_signatures(self.signatures)


def spike_config(
    options: RecorderOptions, optimizers: list[Any], framework: str, cannot_skip: str | None
) -> SpikeConfig | None:
    """The checked options (the Guard's checks: the same errors, naming the argument), with
    ``on_spike`` as attach mode can carry it out for ``framework``: ``"rewind"`` becomes
    ``"skip"``, and where ``cannot_skip`` (why the framework's step cannot be skipped)
    ``"skip"`` / ``"rewind"`` / ``"raise"`` become ``"warn"``; each change warns once, saying
    why. None when nothing is recorded or detected."""
    every = options.snapshot_every
    snapshots = every is not None
    config = check_flight_recorder(
        options.flight_recorder,
        DEFAULT_SNAPSHOT_EVERY if every is None else every,
        snapshots or options.on_spike == "rewind",
        options.on_spike,
        optimizers,
        [],
    )
    if config is None:
        return None
    config = replace(config, snapshot=snapshots and config.snapshot)
    asked = config.on_spike
    if asked in ("skip", "rewind", "raise") and cannot_skip is not None:
        _say(
            f"on_spike={asked!r} under {framework}: {cannot_skip}, so attach mode cannot keep a "
            "spiked step out of the weights. Spikes are detected, recorded (AG180) and dumped, "
            "and each one warns (as on_spike='warn'); ampguard.Guard skips them"
        )
        return replace(config, on_spike="warn")
    if asked == "rewind":
        _say(
            f"on_spike='rewind' under {framework}: attach mode cannot rewind ({framework} owns "
            "the data order and the LR schedule); a spiked step is skipped instead (as "
            "on_spike='skip'). ampguard.Guard rewinds"
        )
        return replace(config, on_spike="skip")
    return config


def _say(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())


class AttachRecorder:
    """The Guard's :class:`~ampguard.guard.SpikeWatch` fed by a watched loop (see the module
    docstring). ``telemetry``: the watch's (its run folder receives the dumps)."""

    def __init__(
        self,
        config: SpikeConfig,
        model: torch.nn.Module,
        optimizers: list[Any],
        device: torch.device,
        telemetry: Any,
        scaled: bool,
    ) -> None:
        host = SimpleNamespace(model=model, optimizers=optimizers, device=device, dist=_dist())
        spikes = attach_flight_recorder(config, host, [], telemetry)
        assert spikes is not None  # config is not None
        self.spikes: SpikeWatch = spikes
        self.n_optimizers, self.scaled = len(optimizers), scaled
        self.window = 0  # the last window begun
        self._losses: list[torch.Tensor] = []
        # gradients sampled when a backward ends, before the window begins (no scaler): a
        # one-row ring of the same parameters, copied into the window's row when it begins
        self._sample = FlightRecorder(1, spikes.names, [], device)
        self._sampled = False
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        self._batch: tuple[int, Any, Any] = (0, None, None)  # (window, batch, loss_fn)
        self._acted: set[int] = set()  # windows whose spike decide() acted on
        self._recording = False  # the window begun has its row in the ring (a loss came)

    @property
    def acts(self) -> bool:
        """A spike skips its window (``on_spike`` ``"skip"`` or ``"raise"`` here)."""
        return self.spikes.config.acts

    # ------------------------------------------------------------------ hot path (no sync)
    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's (unscaled) loss of the window in progress."""
        self._losses.append(loss.detach())

    def sample_grads(self) -> None:
        """A backward pass ended: take the gradients' norms now (before the loop clips them);
        the window's last backward leaves the sample. Cost: one multi-tensor norm."""
        self._sample.start(0, [])
        self._sample.put_grad_norms(0, [p.grad for p in self.spikes.params], None)
        self._sampled = True

    def begin(self, window: int, inv_scale: torch.Tensor | None = None) -> None:
        """The gradients of ``window`` are final: run the detector on its losses, record them,
        its LRs and gradient norms (``inv_scale``: they still carry the loss scale). Once per
        window. Cost: about 20 device ops, no host sync."""
        if window == self.window:
            return
        self.window = window
        losses, self._losses = self._losses, []
        self.spikes.begin(window, [x.float().reshape(()) for x in losses])
        self._recording = bool(losses)
        if not losses:  # no loss reached the watch: the window has no row in the ring
            self._sampled = False
            return
        if self._sampled:
            self._sampled = False
            self.spikes.ring.put_vector(window, "grad_norm", self._sample.grad_norm[0])
        else:
            self.spikes.on_grads(window, inv_scale)

    def skip_flag(self, window: int) -> torch.Tensor | None:
        """The 0-dim 0/1 flag that skips ``window`` when its loss spiked (None: nothing to
        skip on: not acting, or no loss recorded)."""
        if not self.acts or window != self.window:
            return None
        return self._flag()

    def _flag(self) -> torch.Tensor | None:
        """The window's spike flag, agreed by the ranks where a spike skips (waits for the
        flag's async all-reduce; no host sync)."""
        got = self.spikes.spike_flag()
        return None if got is None else got[0]

    def status_bits(self, n: int) -> torch.Tensor | None:
        """The window's spike bits for its packed flags (``ampguard.core.results.pack``'s bits
        n + 3 and, when it skips, n + 4), or None."""
        flag = self._flag()
        if flag is None:
            return None
        return flag * float(2 ** (n + 3) + (2 ** (n + 4) if self.acts else 0))

    def end(self, window: int, status: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        """``window`` is over (applied or skipped): its flags and scale into the ring, the
        sampled update ratios, a snapshot when one is due (``snapshot_every``), and the flag
        kept for the next host read. Cost: device ops; a snapshot's device-to-host copy."""
        if window != self.window:
            return  # no loss reached this window: the detector did not see it
        flag = self._flag()
        if status is not None and self._recording:
            self.spikes.on_status(window, status, scale)
        if flag is not None:
            self._pending.append((window, flag, status))
            # "raise": raised from the step it skipped; snapshots: a spike is settled before
            # this window's snapshot, as the Guard does (its pinned snapshot is the one before);
            # both cost one host sync per window
            if self.spikes.config.on_spike == "raise" or self.spikes.snapshots is not None:
                self.settle()
        batch, fn = self._batch[1:] if self._batch[0] == window else (None, None)
        self.spikes.after_step(_window(window, scale), batch, fn)

    def keep_batch(self, window: int, batch: Any, loss_fn: Any) -> None:
        """The batch of ``window`` and ``loss_fn(model, batch)``, for ``ampguard.triage``.
        Without snapshots the latest window's is kept (the one a triage can replay from the
        model as it is); with ``snapshot_every`` the Guard's bookkeeping keeps those since the
        older kept snapshot. Cost: a reference, no copy."""
        self._batch = (window, batch, loss_fn)
        if self.spikes.snapshots is None:
            self.spikes.batches.clear()
            self.spikes.batches[window] = [(batch, loss_fn)]  # the Guard's format

    # ------------------------------------------------------------------ on the host
    def decide(self, window: int) -> bool:
        """Read ``window``'s spike flag now and act on a spike (a loop whose step ampguard
        skips in Python: the caller then does not step). ``"raise"``: ``LossSpikeError``.
        Cost: one host sync."""
        flag = self.skip_flag(window)
        if flag is None:
            return False
        spiked = bool(flag.item())
        if spiked:
            self._acted.add(window)
            self.spikes.on_spike(window, None)
        return spiked

    def settle(self) -> None:
        """Read the pending windows' flags (one host sync for all) and act: warn or record each
        spike (AG180; ``"raise"``: ``LossSpikeError``), dump the ring on a spike or on
        non-finite gradients."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        flags = [f.float().reshape(()) for _, f, _ in pending]
        packed = [
            f if s is None else s.float().reshape(()).to(f.device)
            for (_, _, s), f in zip(pending, flags, strict=True)
        ]
        values = torch.stack([torch.stack(flags), torch.stack(packed)]).tolist()
        for (window, _, status), spiked, bits in zip(pending, *values, strict=True):
            if window in self._acted:  # decided (and acted on) before its step
                self._acted.discard(window)
            elif spiked:
                self.spikes.on_spike(window, None)
            elif status is not None and self.spikes.dumper is not None:
                read = results.decode(int(bits), self.n_optimizers, self.scaled)
                if read.nonfinite or read.loss_nonfinite:
                    self.spikes.dumper.dump("nonfinite", window)

    def on_error(self, err: BaseException) -> None:
        """The framework reports an exception: the ring is dumped. Never raises."""
        self.spikes.on_error(err, self.window)

    def findings(self) -> list[Finding]:
        """AG180 per detected spike. Cost: one host sync (settles the pending flags)."""
        self.settle()
        return self.spikes.findings()

    def scale_used_at(self, window: int) -> float:
        """The loss scale ``window`` ran with, from the ring (1.0 where it kept none). Cost:
        one host sync."""
        for row in self.spikes.ring.rows():
            if row["step"] == window and row.get("scale") is not None:
                return float(row["scale"])
        return 1.0

    def close(self) -> None:
        """Settle the flags still pending and remove the SIGTERM handler of the dumps."""
        try:
            self.settle()
        finally:
            self.spikes.close()


def _window(window: int, scale: torch.Tensor | None) -> Any:
    """What ``SpikeWatch.after_step`` reads of a Guard's ``StepState``."""
    return SimpleNamespace(
        steps=window, scaled=scale is not None, loss_scale=SimpleNamespace(scale_tensor=scale)
    )


class _Dist:
    """What ``SpikeWatch`` needs of a process group (rank, world size, the default group) for
    a watched loop under ``torch.distributed``: every rank dumps its own file and, where a
    spike skips, the ranks agree on the flag (one async all-reduce of one float)."""

    def __init__(self) -> None:
        dist = torch.distributed
        self.group = None
        self.topology = SimpleNamespace(
            global_rank=dist.get_rank(), world_size=dist.get_world_size()
        )

    def collectives(self, what: str, step: int) -> Any:
        return contextlib.nullcontext()


def _dist() -> _Dist | None:
    dist = torch.distributed
    return _Dist() if dist.is_available() and dist.is_initialized() else None
