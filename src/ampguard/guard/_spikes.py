"""The Guard's flight recorder and loss-spike policy (``flight_recorder=``, ``snapshot_every=``,
``snapshot=``, ``on_spike=``).

Per window, all on the device and without a host sync: the loss goes to the spike detector
(:class:`ampguard.replay.SpikeDetector`) and the ring buffer
(:class:`ampguard.replay.FlightRecorder`) with the LR of every param group (a tensor LR copied
on the device, never read), the gradient norms (after the unscale, before the clip; the clip
reuses them), the packed step flags and the loss scale, written as one row by one stack;
sampled windows (every ``SAMPLE_EVERY``) also record the update-to-weight ratios and the
per-module output amax (:class:`ampguard.replay.OutputAmax`: hooks only for that forward).
Under a process group, when a spike skips its window
(``on_spike`` ``"skip"``, ``"rewind"``, ``"raise"``), the ranks OR their spike flags (one async
all-reduce of one float, overlapped with the unscale), so no rank applies an update another rank
skips; with ``"warn"`` each rank judges its own loss and no collective runs.

The detector's flag joins the window's packed flags (:func:`ampguard.core.results.pack`). With
``on_spike`` ``"skip"``, ``"rewind"`` or ``"raise"`` it also skips the window, like non-finite
gradients: fused optimizers get it in their ``found_inf``, the others are not stepped, the loss
scale does not move, schedulers and ``on_applied`` callbacks do not advance. When the flags reach
the host (at once for optimizers stepping in Python, lazily for fused ones) the policy acts:
``"warn"`` warns, ``"rewind"`` restores the last snapshot taken at least two windows before the
spike (weights, buffers, optimizer, schedulers, the loss scale with its growth tracker and
hysteresis budget, RNG), ``"raise"`` raises
:class:`ampguard.LossSpikeError`. Every spike is an AG180 finding giving its size.

Every ``snapshot_every`` windows a snapshot is taken (``ampguard.replay.SnapshotStore``: host
memory by default, a folder with ``snapshot=PATH``); with ``step(batch=..., loss_fn=...)`` the
batches since the older kept snapshot are kept (references) for ``ampguard.autopsy``.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ampguard._util.stack import user_stacklevel
from ampguard.findings import Finding, make
from ampguard.guard._recorder import Dumper, run_dir_of
from ampguard.guard._spike_config import (
    DEFAULT_CAPACITY,
    DEFAULT_SNAPSHOT_EVERY,
    ON_SPIKE,
    SAMPLE_EVERY,
    SpikeConfig,
    check,
    has_state,
)
from ampguard.replay import (
    SPIKE_RUN,
    FlightRecorder,
    LossSpikeError,
    OutputAmax,
    Snapshot,
    SnapshotStore,
    SpikeDetector,
    grad_norms,
    local,
)

__all__ = [
    "ON_SPIKE",
    "SpikeConfig",
    "SpikeEvent",
    "SpikeWatch",
    "attach",
    "check",
    "scale_state",
    "DEFAULT_CAPACITY",
    "DEFAULT_SNAPSHOT_EVERY",
]


@dataclass
class SpikeEvent:
    """A detected spike, once its flags are on the host."""

    step: int
    loss: float
    bound: float
    level: float
    action: str | None
    snapshot_step: int | None = None  # rewind: the snapshot restored
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """The loss over its running level (``exp`` of the running mean of the log-loss)."""
        return self.loss / self.level if self.level > 0 else math.inf


class SpikeWatch:
    """What a Guard with a flight recorder or ``on_spike`` keeps (see the module docstring)."""

    def __init__(
        self,
        config: SpikeConfig,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[Any],
        device: torch.device,
        dist: Any = None,
    ) -> None:
        self.config = config
        self.model, self.optimizers = model, optimizers
        # a scheduler without state_dict() is left out of snapshots (a rewind says so)
        self.schedulers = [s for s in schedulers if has_state(s)]
        self.unsaved_schedulers = len(schedulers) - len(self.schedulers)
        self.device = device
        self.dist = dist
        names = {id(p): n for n, p in model.named_parameters()}
        self.params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        self.names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        self._sharded = any(callable(getattr(p, "to_local", None)) for p in self.params)
        self.detector = SpikeDetector(device)
        groups = sum(len(opt.param_groups) for opt in optimizers)
        # the sampled output amax of the layers (with a recorder only)
        self.amax = OutputAmax(model) if config.capacity else None
        modules = [] if self.amax is None else self.amax.names
        # flight_recorder=False with on_spike: an 8-window ring (the spike's loss for the
        # message), never dumped
        self.ring = FlightRecorder(config.capacity or 8, self.names, modules, device, groups)
        snap = config.snapshot
        self.snapshots = (
            None if snap is False else SnapshotStore(2, None if snap is True else Path(snap))
        )
        # step -> its micro-batches' (batch, loss_fn), in order (one without accumulation)
        self.batches: OrderedDict[int, list[tuple[Any, Any]]] = OrderedDict()
        self._micro: list[tuple[Any, Any]] = []  # the window's micro-batches so far
        self.events: list[SpikeEvent] = []
        self.flag: torch.Tensor | None = None  # this window's spike flag (0-dim 0/1 float)
        self._work: Any = None  # the flag's in-flight all-reduce
        self.step = 0  # the last window begun
        self._weights: list[torch.Tensor] | None = None  # sampled window: weights before
        self._clip_parts: list[torch.Tensor] | None = None  # see clip_parts()
        self.dumper: Any = None  # ampguard.guard._recorder.Dumper, set by the Guard

    # ------------------------------------------------------------------ per window
    def begin(self, step: int, losses: list[torch.Tensor]) -> None:
        """Window ``step`` is complete: record its loss and LRs, run the detector, and start
        the ranks' agreement on its flag. A tensor LR is recorded on the device (never read
        on the host). Cost: about 15 small device ops and (distributed) one async all-reduce;
        on sampled windows one multi-tensor copy of the parameters; no host sync."""
        if not losses:
            self.flag = None
            return
        loss = losses[0] if len(losses) == 1 else torch.stack([x.float() for x in losses]).mean()
        ring = self.ring
        lrs = [g.get("lr", math.nan) for opt in self.optimizers for g in opt.param_groups]
        ring.open(step, lrs)  # a tensor LR is staged for the device row, never read
        flag, record = self.detector.measure(loss)
        ring.stage(step, detector=record)
        if self.config.acts and self.dist is not None and torch.distributed.is_initialized():
            flag = flag.clone()  # the ranks' agreed flag; the ring keeps this rank's own
            self._work = torch.distributed.all_reduce(
                flag, op=torch.distributed.ReduceOp.MAX, group=self.dist.group, async_op=True
            )
        self.flag, self.step = flag, step
        if step % SAMPLE_EVERY == 0 and self.config.capacity:
            self._weights = list(torch._foreach_mul(self._local_params(), 1.0))  # one copy
        if self.amax is not None:
            self.amax.finish(step, ring)

    def _local_params(self) -> list[torch.Tensor]:
        if self._sharded:
            return [local(p.detach()) for p in self.params]
        return [p.detach() for p in self.params]

    def on_grads(self, step: int, inv_scale: torch.Tensor | None) -> None:
        """The window's per-parameter gradient norms (``inv_scale``: the gradients are still
        scaled). Cost: one multi-tensor norm, no host sync."""
        grads = [p.grad for p in self.params]
        if self._sharded:
            grads = [None if g is None else local(g) for g in grads]
        norms = grad_norms(grads)
        self.ring.stage(step, grad_norm=norms, inv=inv_scale)
        # the clip's total norm can be taken from these (the same kernel on the same list)
        # when torch's get_total_norm would not regroup them: one fp32 group, no shards
        self._clip_parts = None
        if norms is not None and inv_scale is None and not self._sharded and self.dist is None:
            present = [g for g in grads if g is not None]
            dev = present[0].device
            if all(g.dtype == torch.float32 and g.device == dev for g in present):
                self._clip_parts = [n for n in norms if n is not None]

    def clip_parts(self) -> list[torch.Tensor] | None:
        """The per-parameter norms of the window's unscaled gradients, in the order
        ``torch.nn.utils.get_total_norm`` would compute them (its total is their 2-norm,
        bitwise), or None where it would compute them otherwise. Cost: none."""
        parts, self._clip_parts = self._clip_parts, None
        return parts

    def spike_flag(self) -> tuple[torch.Tensor, bool] | None:
        """``(flag, skips)`` for the window's packed flags (the ranks' agreed flag), or None.
        Cost: waits for the flag's all-reduce (no host sync)."""
        if self.flag is None:
            return None
        if self._work is not None:
            with self.dist.collectives("the loss-spike agreement", self.step):
                self._work.wait()
            self._work = None
        return self.flag, self.config.acts

    def skip_found(self, found: list[torch.Tensor]) -> list[torch.Tensor]:
        """``found`` with the acting spike flag added: what fused optimizers skip on."""
        if self.flag is None or not self.config.acts:
            return found
        return [f + self.flag for f in found]

    def on_status(self, step: int, status: torch.Tensor, scale: torch.Tensor | None) -> None:
        """The window's packed flags and loss scale: its row is written to the ring (one
        stack of the loss, the detector's record, the flags, the scale, the gradient norms and
        any tensor LR). Cost: one or two device ops, no host sync."""
        self.ring.stage(step, status=status, scale=scale)
        self.ring.commit()

    def after_step(self, state: Any, batch: Any, loss_fn: Any) -> None:
        """After the window of ``state`` (a ``StepState``; its update applied or skipped): the
        sampled update ratios, the batch (for the autopsy) and a snapshot when one is due.
        Cost: device ops and a device-to-host copy every ``snapshot_every`` windows; no host
        sync."""
        step = state.steps
        scale = scale_state(state)
        if self._weights is not None:
            before, self._weights = self._weights, None
            den = _norms(before)
            torch._foreach_sub_(before, self._local_params())  # -update, in the copy
            ratio = torch.stack(_norms(before)).div_(torch.stack(den).clamp_min_(1e-30))
            self.ring.put_sampled(step, "update_ratio", ratio)
        if self.amax is not None and (step + 1) % SAMPLE_EVERY == 0:
            self.amax.arm(step + 1)  # the next window's forward is sampled
        micro, self._micro = [*self._micro, (batch, loss_fn)], []
        if self.snapshots is None:
            return
        if all(b is not None and fn is not None for b, fn in micro):
            self.batches[step] = micro
        if step % self.config.snapshot_every == 0:
            self.snapshots.add(step, self.model, self.optimizers, self.schedulers, scale)
            for k in [k for k in self.batches if not self._needed(k)]:
                del self.batches[k]

    def on_micro(self, batch: Any, loss_fn: Any) -> None:
        """A micro-batch that is not the window's last (``accumulation_steps > 1``): kept
        with the window's others for the autopsy. Cost: a reference, no device work."""
        self._micro.append((batch, loss_fn))

    def _needed(self, step: int) -> bool:
        """A replay can still use window ``step``'s batch: after the oldest kept snapshot, or
        between a spike and the snapshot pinned for it."""
        assert self.snapshots is not None
        live = self.snapshots.snapshots
        if live and step > live[0].step:
            return True
        return any(s.step < step <= t for t, s in self.snapshots.spikes.items())

    def on_error(self, err: BaseException, step: int) -> None:
        """An exception leaves ``Guard.step()`` (a peer failure, a collapse, a raised spike):
        every rank that gets here dumps its ring. Never raises."""
        self._micro = []  # the failed window's micro-batches must not join the next window's
        if self.dumper is not None and isinstance(err, Exception):
            self.dumper.dump(type(err).__name__, step)

    # ------------------------------------------------------------------ on the host
    def on_spike(self, step: int, scale: Any, skipped_for: str | None = None) -> SpikeEvent:
        """Window ``step``'s flags, read on the host, say its loss spiked: act on it (see the
        module docstring). ``skipped_for``: the other cause that skipped the window (an fp16
        overflow), said instead of "applied". Cost: one host sync (the loss and bound)."""
        loss, bound, level = self._recorded(step)
        action = self.config.on_spike
        event = SpikeEvent(step, loss, bound, level, action)
        if skipped_for is not None:
            event.extra["skipped_for"] = skipped_for
        last = self.events[-1] if self.events else None
        run = last.extra.get("run", 1) + 1 if last is not None and last.step == step - 1 else 1
        event.extra["run"] = run
        if run % SPIKE_RUN == 0:  # the detector takes this window's loss as its new level
            event.extra["level_shift"] = step - SPIKE_RUN + 1
        self.events.append(event)
        if self.snapshots is not None:  # a snapshot taken after the spike holds its damage
            self.snapshots.drop_from(step)
            self.snapshots.pin(step)  # the one before it stays for the autopsy
        size = f"{event.ratio:.3g}x its running level" if math.isfinite(event.ratio) else "?"
        msg = f"loss spike at step {step}: loss {loss:.4g}, {size} (bound {bound:.4g})"
        if self.dumper is not None:
            self.dumper.dump("loss_spike", step)
        if action == "warn":
            did = _outcome(event)
            warnings.warn(
                f"{msg}; {did} (on_spike='warn'). ampguard.autopsy(guard) names the cause; "
                "on_spike='skip' or 'rewind' keeps such a step out of the weights",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        elif action == "rewind":
            self._rewind(event, scale)
        elif action == "raise":
            raise LossSpikeError(
                msg + "; the step was skipped (on_spike='raise'). ampguard.autopsy(guard) "
                "names the cause",
                step=step,
                loss=loss,
                bound=bound,
            )
        return event

    def _rewind(self, event: SpikeEvent, scale: Any) -> None:
        snap: Snapshot | None = None
        if self.snapshots is not None:
            snap = self.snapshots.before(event.step - 1)
        if snap is None:
            warnings.warn(
                f"loss spike at step {event.step}: no snapshot from before step "
                f"{event.step - 1} yet (snapshot_every={self.config.snapshot_every}); the step "
                "was skipped instead of rewound",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
            return
        snap.restore(self.model, self.optimizers, self.schedulers, scale)
        event.snapshot_step = snap.step
        warnings.warn(
            f"loss spike at step {event.step} (loss {event.loss:.4g}, {event.ratio:.3g}x its "
            f"running level): rewound to the snapshot after step {snap.step}; the batches of "
            f"steps {snap.step + 1}..{event.step} are left out (on_spike='rewind')",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    def _recorded(self, step: int) -> tuple[float, float, float]:
        got = self.ring.recorded(step)
        return (math.nan, math.nan, math.nan) if got is None else got

    def findings(self) -> list[Finding]:
        """One AG180 per detected spike (its step, loss, bound, size and action). Cost: none."""
        out = []
        for e in self.events:
            did = {
                "warn": _outcome(e),
                "skip": "the step was skipped",
                "raise": "the step was skipped and the run stopped",
                "rewind": (
                    f"the run was rewound to step {e.snapshot_step}"
                    if e.snapshot_step is not None
                    else "the step was skipped (no snapshot to rewind to)"
                ),
            }.get(e.action or "", "recorded")
            first = e.extra.get("level_shift")
            if first is not None:
                did += (
                    f". The loss stayed above the bound for {SPIKE_RUN} windows in a row (steps "
                    f"{first}-{e.step}): the detector took it as the loss's new level, and later "
                    "windows are judged against it (and applied). A skip cannot undo an update "
                    "that raised the loss: on_spike='rewind' restores the weights from before "
                    "it, and ampguard.autopsy(guard) names the cause"
                )
            out.append(
                make(
                    "AG180",
                    f"The loss spiked at step {e.step}: {e.loss:.4g}, {e.ratio:.3g}x its running "
                    f"level (the detector's bound was {e.bound:.4g}); {did}.",
                    step=e.step,
                    detail=f"step {e.step}, {e.ratio:.3g}x",
                    evidence={
                        "loss": _finite(e.loss),
                        "bound": _finite(e.bound),
                        "level": _finite(e.level),
                        "ratio": _finite(e.ratio),
                        "action": e.action,
                        "snapshot_step": e.snapshot_step,
                        "level_shift_from": first,
                    },
                )
            )
        return out

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """The detector's statistic for ``Guard.state_dict()``. Cost: one host sync."""
        return self.detector.state_dict()

    def close(self) -> None:
        """The Guard closes: the SIGTERM handler of the dumps and the amax hooks go."""
        if self.amax is not None:
            self.amax.close()
        if self.dumper is not None:
            self.dumper.release()

    def memory(self) -> dict[str, int]:
        """Bytes held: ``ring`` (device) and ``snapshots`` (host memory)."""
        return {
            "ring": 0 if self.ring is None else self.ring.memory_bytes(),
            "snapshots": 0 if self.snapshots is None else self.snapshots.nbytes,
        }


def attach(
    config: SpikeConfig | None, state: Any, schedulers: list[Any], telemetry: Any
) -> SpikeWatch | None:
    """The :class:`SpikeWatch` of the Guard whose ``StepState`` is ``state`` (None when ``config``
    is None), with a dumper into the
    run folder of ``telemetry`` (every rank's, also those that write no run log)."""
    if config is None:
        return None
    watch = SpikeWatch(config, state.model, state.optimizers, schedulers, state.device, state.dist)
    rank, world = 0, 1
    if state.dist is not None:
        rank, world = state.dist.topology.global_rank, state.dist.topology.world_size
    run_dir = run_dir_of(telemetry, rank)
    if run_dir is not None and config.capacity:
        watch.dumper = Dumper(watch, run_dir, rank, world)
        watch.dumper.on_sigterm(lambda: watch.step)
    return watch


def scale_state(state: Any) -> dict[str, torch.Tensor] | None:
    """The live loss-scale tensors of a Guard's ``StepState`` (the scale, the growth tracker,
    the hysteresis budget) that a snapshot keeps and a rewind copies back; None without a
    scale."""
    if not state.scaled:
        return None
    tensors = getattr(state.loss_scale, "state_tensors", None)
    return dict(tensors) if tensors is not None else {"scale": state.loss_scale.scale_tensor}


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 2-norms of ``tensors`` in one multi-tensor op."""
    if all(t.dtype == torch.float32 for t in tensors):
        return list(torch._foreach_norm(tensors))
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def _finite(v: float) -> float | None:
    return round(v, 6) if math.isfinite(v) else None


def _outcome(event: SpikeEvent) -> str:
    """What happened to a spike's step under ``on_spike="warn"``: applied, or skipped for its
    other cause (an fp16 overflow in the same window)."""
    other = event.extra.get("skipped_for")
    return "the step was applied" if other is None else f"the step was skipped anyway ({other})"
