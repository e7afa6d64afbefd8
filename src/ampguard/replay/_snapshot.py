"""Snapshots of a training loop's state: weights, buffers, optimizer, schedulers, loss scale, RNG.

One format (:class:`Snapshot`), in host memory by default, on disk on request (``torch.save``
into a folder, written atomically). A snapshot is taken right after window ``step`` updated
the weights: restoring it puts the loop where it was when window ``step + 1`` began.

Memory: one copy of the parameters and buffers plus the optimizer state (Adam: two more tensors
per parameter), in host memory: buffers allocated once per pool and reused by later snapshots
(pinned from an accelerator), filled by one multi-tensor copy (non-blocking from an
accelerator, so taking one never waits for the device). A
:class:`SnapshotStore` keeps the last ``keep`` of them (2: the spike rewind and the autopsy need
the one before the spike, which may be the one before the last). On disk: the same bytes in
``RUN_DIR/snapshots/step_<N>.pt`` and none in memory.

Cost of taking one: a device-to-host copy of the state (no host sync on an accelerator; on the
CPU a plain copy); the RNG states are host copies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ampguard._util.atomic import atomic_write
from ampguard.replay._rng import rng_state, set_rng_state

__all__ = ["Snapshot", "SnapshotStore", "state_bytes"]


def _copy_tree(
    value: Any,
    pinned: dict[int, torch.Tensor] | None,
    key: list[int],
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> Any:
    """The tree of ``value`` (dicts, lists, tuples kept) with every tensor replaced by its host
    buffer (reused from ``pinned`` when one of the same shape and dtype is there, else new;
    pinned from an accelerator); ``(buffer, tensor)`` go to ``pairs`` for one multi-tensor
    copy."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        k = key[0]
        key[0] += 1
        buf = None if pinned is None else pinned.get(k)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type != "cpu" and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            if pinned is not None:
                pinned[k] = buf
        pairs.append((buf, t))
        return buf
    if isinstance(value, dict):
        return {k: _copy_tree(v, pinned, key, pairs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_tree(v, pinned, key, pairs) for v in value)
    return value


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Fill the buffers: one ``_foreach_copy_`` (non-blocking from an accelerator)."""
    if pairs:
        dst, src = zip(*pairs, strict=True)
        torch._foreach_copy_(list(dst), list(src), non_blocking=True)


def state_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_bytes(v) for v in value)
    return 0


@dataclass
class Snapshot:
    """The loop's state right after window ``step`` (see the module docstring)."""

    step: int
    model: dict[str, Any]
    optimizers: list[dict[str, Any]]
    schedulers: list[dict[str, Any]]
    scale: dict[str, Any] | None  # the loss scale's tensors (None without one)
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None  # on disk: where, with the tensors dropped from memory

    @classmethod
    def take(
        cls,
        step: int,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[Any],
        scale: dict[str, torch.Tensor] | None,
        pinned: dict[int, torch.Tensor] | None = None,
    ) -> Snapshot:
        """Copy the state now. ``pinned``: reusable host buffers (keyed by position).
        Cost: see the module docstring."""
        key = [0]
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        snap = cls(
            step,
            _copy_tree(model.state_dict(), pinned, key, pairs),
            [_copy_tree(opt.state_dict(), pinned, key, pairs) for opt in optimizers],
            [_copy_tree(s.state_dict(), pinned, key, pairs) for s in schedulers],
            None if scale is None else _copy_tree(scale, pinned, key, pairs),
            rng_state(device_type),
        )
        _copy_all(pairs)
        return snap

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors held (0 once on disk)."""
        return state_bytes([self.model, self.optimizers, self.schedulers, self.scale])

    def save(self, folder: str | os.PathLike) -> Path:
        """Move the tensors to ``folder/step_<N>.pt`` (temporary file, fsync, rename) and drop
        them from memory. Cost: one host sync (the copies must be complete) and the write."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{self.step}.pt"
        atomic_write(path, lambda fh: torch.save(self._payload(), fh))  # a failed write: no trace
        self.path = path
        self.model, self.optimizers, self.schedulers, self.scale = {}, [], [], None
        return path

    def _payload(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.model,
            "optimizers": self.optimizers,
            "schedulers": self.schedulers,
            "scale": self.scale,
            "rng": self.rng,
        }

    def loaded(self) -> Snapshot:
        """This snapshot with its tensors in memory (read from disk if it was saved)."""
        if self.path is None:
            return self
        data = torch.load(self.path, weights_only=True)
        return Snapshot(
            data["step"],
            data["model"],
            data["optimizers"],
            data["schedulers"],
            data["scale"],
            data["rng"],
        )

    def restore(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[Any],
        scale: dict[str, torch.Tensor] | None = None,
        *,
        rng: bool = True,
    ) -> None:
        """Put the state back into ``model``, ``optimizers``, ``schedulers`` (same order as at
        :meth:`take`), the loss scale's tensors ``scale`` (copied in place) and, with ``rng``,
        the global RNG. Cost: host-to-device copies, no host sync."""
        snap = self.loaded()
        model.load_state_dict(snap.model)
        for opt, sd in zip(optimizers, snap.optimizers, strict=True):
            opt.load_state_dict(_clone_tree(sd))
        for sched, sd in zip(schedulers, snap.schedulers, strict=True):
            sched.load_state_dict(_clone_tree(sd))
        if scale is not None and snap.scale is not None:
            for k, t in scale.items():
                t.copy_(snap.scale[k])
        if rng:
            device_type = next((p.device.type for p in model.parameters()), "cpu")
            set_rng_state(device_type, snap.rng)


def _clone_tree(value: Any) -> Any:
    # optimizer.load_state_dict keeps (or casts) the tensors it is given: give it copies, so a
    # snapshot restored twice (the rewind, then the autopsy) starts from the same bytes
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tree(v) for v in value)
    return value


class SnapshotStore:
    """The last ``keep`` snapshots, in memory or (``folder``) on disk.

    In memory the pinned host buffers of a dropped snapshot are reused by a later one, so a run
    allocates them ``keep + 1`` times at most."""

    def __init__(self, keep: int = 2, folder: str | os.PathLike | None = None) -> None:
        self.keep = keep
        self.folder = None if folder is None else Path(folder)
        self.snapshots: list[Snapshot] = []
        # pools of pinned host buffers: the new snapshot never writes into a live one
        self._pinned: list[dict[int, torch.Tensor]] = []
        self.spikes: dict[int, Snapshot] = {}  # spike step -> the snapshot before it (pinned)
        self.max_spikes = 2

    def add(
        self,
        step: int,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[Any],
        scale: dict[str, torch.Tensor] | None,
    ) -> Snapshot:
        """Take a snapshot after window ``step``; the oldest beyond ``keep`` is dropped (its
        file deleted). Cost: :meth:`Snapshot.take` (on disk: plus :meth:`Snapshot.save`)."""
        live = self.snapshots[-(self.keep - 1) :] if self.keep > 1 else []
        used = {s.extra.get("pool") for s in [*live, *self.spikes.values()]}
        pool = next(i for i in range(len(self._pinned) + 1) if i not in used)
        if pool == len(self._pinned):
            self._pinned.append({})
        pinned = self._pinned[pool] if self.folder is None else None
        snap = Snapshot.take(step, model, optimizers, schedulers, scale, pinned)
        snap.extra["pool"] = pool
        if self.folder is not None:
            snap.save(self.folder)
        self.snapshots.append(snap)
        while len(self.snapshots) > self.keep:
            self._forget(self.snapshots.pop(0))
        return snap

    def _forget(self, old: Snapshot) -> None:
        held = [*self.snapshots, *self.spikes.values()]
        if old.path is not None and all(s.path != old.path for s in held):
            old.path.unlink(missing_ok=True)

    def pin(self, spike_step: int) -> Snapshot | None:
        """Keep the snapshot before the spike at ``spike_step`` (taken before ``spike_step -
        1``) for the autopsy, whatever is taken later; the last ``max_spikes`` spikes are kept
        (so at most that many more snapshots are held)."""
        snap = self.before(spike_step - 1)
        if snap is None:
            return None
        self.spikes[spike_step] = snap
        while len(self.spikes) > self.max_spikes:
            self._forget(self.spikes.pop(min(self.spikes)))
        return snap

    def for_spike(self, spike_step: int) -> Snapshot | None:
        """The snapshot pinned for the spike at ``spike_step``, else the newest one before
        ``spike_step - 1``."""
        return self.spikes.get(spike_step) or self.before(spike_step - 1)

    def before(self, step: int) -> Snapshot | None:
        """The newest snapshot taken after a window earlier than ``step`` (None if none)."""
        found = [s for s in self.snapshots if s.step < step]
        return found[-1] if found else None

    def drop_from(self, step: int) -> None:
        """Forget the snapshots taken at or after window ``step`` (a spike found there late)."""
        self.snapshots = [s for s in self.snapshots if s.step < step]

    @property
    def nbytes(self) -> int:
        """Bytes held in memory by the snapshots (those pinned for spikes included)."""
        held = {id(s): s for s in [*self.snapshots, *self.spikes.values()]}
        return sum(s.nbytes for s in held.values())
