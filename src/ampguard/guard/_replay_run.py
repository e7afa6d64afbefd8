"""The autopsy's counterfactual replays: copies of the loop and a Guard over them.

:class:`Replay` deep-copies the model, optimizers and schedulers, restores a snapshot into the
copies and replays recorded windows through a fresh ``Guard`` with what changes the numbers of
the run (precision, clipping, ``accumulation_steps``, ``fp32_optimizer_states``, a Kahan /
stochastic rescue; no recorder) and the LRs the run stepped with. A window is replayed as the
Guard saw it: every recorded micro-batch forward and backward, then one step; its loss is the
mean of the micro-batches' losses, as the recorder's. :func:`plain` runs windows ``t - 1`` and
``t`` unchanged. The interventions are in :mod:`ampguard.guard._interventions`. Cost: the
replayed windows; host syncs throughout (a diagnostic, not the hot path).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ampguard.replay import Snapshot

__all__ = ["NotApplicable", "Replay", "Run", "batch_len", "index", "plain"]


class NotApplicable(Exception):
    """An intervention that does not apply to this run (the reason is the message)."""


Run = Callable[[], float]


class Replay:
    """Copies of the loop, a Guard over them, and the window's batches (``batches[step]``: its
    micro-batches' ``(batch, loss_fn)``)."""

    def __init__(self, guard: Any, batches: Any, snap: Snapshot, rows: dict[int, Any]) -> None:
        self.guard, self.batches, self.rows = guard, batches, rows
        self.model, self.optimizers, self.schedulers = copy.deepcopy(
            (guard.model, guard.optimizers, guard.flight_recorder.schedulers)
        )
        snap.restore(self.model, self.optimizers, self.schedulers)
        self.scale = None if snap.scale is None else snap.scale["scale"].clone()
        self.names = [n for n, _ in self.model.named_parameters()]
        rescue = guard.rescue
        self.fp32_states = bool(rescue is not None and rescue.rescue.fp32_states)
        mode = None if rescue is None else rescue.mode
        self.rescue_mode = mode if mode in ("kahan", "stochastic") else None
        self._live: Any = None  # the replay Guard whose rescue hooks are on the copies

    def new_guard(self, *, fp32_optimizer_states: bool | None = None) -> Any:
        """A Guard over the copies: the run's precision, clipping, accumulation and optimizer
        state precision (``fp32_optimizer_states``: instead of the run's), the schedulers
        stepped on applied windows, the loss scale where the replay is; no recorder, no audit."""
        from ampguard.guard._guard import Guard  # the class this package defines

        self.release()
        fp32 = self.fp32_states if fp32_optimizer_states is None else fp32_optimizer_states
        g = Guard(
            self.model,
            self.optimizers,
            precision=self.guard.precision,
            accumulation_steps=self.guard.accumulation_steps,
            clip_grad_norm=self.guard.clip_grad_norm,
            audit_every=None,
            flight_recorder=False,
            on_spike=None,
            snapshot=False,
            stagnation_rescue=self.rescue_mode,
            fp32_optimizer_states=fp32,
        )
        self._live = g
        for sched in self.schedulers:
            g.on_applied(_stepper(sched))
        if self.scale is not None and g.loss_scaler is not None:
            g.loss_scaler.scale_tensor.copy_(self.scale)
        return g

    def release(self) -> None:
        """Detach the last replay Guard's rescue hooks from the copies (a restore after an
        fp32-state replay must load the states in the run's dtype)."""
        if self._live is not None and self._live.rescue is not None:
            self._live.rescue.close()
        self._live = None

    def micro(self, step: int) -> list[tuple[Any, Any]]:
        """Window ``step``'s recorded micro-batches, ``(batch, loss_fn)`` each."""
        return list(self.batches[step])

    def window(
        self,
        g: Any,
        step: int,
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
        train: bool = True,
        keep: Sequence[list[int] | None] | None = None,
    ) -> float:
        """Replay window ``step`` (``train=False``: its forward only) and return its loss, the
        mean over its micro-batches. ``keep``: per micro-batch, the samples kept (None: all; an
        empty list leaves that micro-batch out). ``before``/``after``: run around the step."""
        values = []
        for i, (batch, loss_fn) in enumerate(self.micro(step)):
            kept = None if keep is None else keep[i]
            if kept is not None:
                if not kept:
                    continue
                batch = index(batch, kept)
            with torch.set_grad_enabled(train), g.autocast():
                loss = loss_fn(self.model, batch)
            values.append(float(loss.detach().float()))
            if train:
                g.backward(loss)
        value = sum(values) / len(values) if values else float("nan")
        if not train:
            return value
        lrs = self.rows.get(step, {}).get("lr")
        groups = [grp for opt in self.optimizers for grp in opt.param_groups]
        if lrs is not None and len(lrs) == len(groups):  # the LRs the run stepped with
            for grp, lr in zip(groups, lrs, strict=True):
                grp["lr"] = lr
        if before is not None:
            before()
        g.step()
        if after is not None:
            after()
        if g.loss_scaler is not None:
            self.scale = g.loss_scaler.scale_tensor.clone()
        return value

    def take(self, step: int) -> Snapshot:
        scale = None if self.scale is None else {"scale": self.scale}
        return Snapshot.take(step, self.model, self.optimizers, self.schedulers, scale)

    def restore(self, snap: Snapshot) -> None:
        self.release()
        snap.restore(self.model, self.optimizers, self.schedulers)
        self.scale = None if snap.scale is None else snap.scale["scale"].clone()

    def grad_scale(self, g: Any) -> float:
        """What the gradients are multiplied by before ``g.step()`` unscales them."""
        return 1.0 if g.loss_scaler is None or self.scale is None else float(self.scale)


def _stepper(sched: Any) -> Callable[[Any], None]:
    def step(_result: Any) -> None:
        sched.step()

    return step


def plain(rep: Replay, step: int) -> tuple[float, float, dict[str, float]]:
    """Windows ``t - 1`` and ``t`` plainly: the losses of both and the update ratios at
    ``t - 1`` (per parameter)."""
    g = rep.new_guard()
    params = dict(rep.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    prev = rep.window(g, step - 1)
    ratios = {
        n: float((p.detach().float() - before[n].float()).norm())
        / max(float(before[n].float().norm()), 1e-30)
        for n, p in params.items()
    }
    return prev, rep.window(g, step, train=False), ratios


def batch_len(batch: Any) -> int | None:
    """The number of samples of ``batch`` (a tensor or a nest of them, all of one length)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)) and batch:
        sizes = {batch_len(b) for b in batch}
        return sizes.pop() if len(sizes) == 1 else None
    if isinstance(batch, dict) and batch:
        sizes = {batch_len(b) for b in batch.values()}
        return sizes.pop() if len(sizes) == 1 else None
    return None


def index(batch: Any, idx: list[int]) -> Any:
    """The samples ``idx`` of ``batch``."""
    if isinstance(batch, torch.Tensor):
        return batch[torch.tensor(idx, device=batch.device)]
    if isinstance(batch, (list, tuple)):
        return type(batch)(index(b, idx) for b in batch)
    if isinstance(batch, dict):
        return {k: index(v, idx) for k, v in batch.items()}
    return batch
