"""The autopsy's counterfactual replays: copies of the loop, a Guard over them, the interventions.

:class:`Replay` deep-copies the model, optimizers and schedulers, restores a snapshot into the
copies and replays recorded windows through a fresh ``Guard`` (same precision and clipping, no
recorder) with the LRs the run stepped with; :func:`plain` runs windows ``t - 1`` and ``t``
unchanged, :func:`interventions` gives each counterfactual (drop the outlier samples, floor
Adam's second moment, clip the suspect layer's update, the layer in fp32, half the LR) as a
function returning the loss at ``t``. Used by :mod:`ampguard.guard._autopsy`. Cost: the replayed
windows; host syncs throughout (a diagnostic, not the hot path).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ampguard.forensics.islands import Fp32Islands
from ampguard.replay import Snapshot
from ampguard.reporting.postmortem import layer_of

__all__ = ["NotApplicable", "Replay", "Run", "interventions", "plain"]


class Replay:
    """Copies of the loop, a Guard over them, and the recorded batches."""

    def __init__(self, guard: Any, watch: Any, snap: Snapshot, rows: dict[int, Any]) -> None:
        self.guard, self.watch, self.rows = guard, watch, rows
        self.model, self.optimizers, self.schedulers = copy.deepcopy(
            (guard.model, guard.optimizers, watch.schedulers)
        )
        snap.restore(self.model, self.optimizers, self.schedulers)
        self.scale = None if snap.scale is None else snap.scale["scale"].clone()
        self.names = [n for n, _ in self.model.named_parameters()]

    def new_guard(self) -> Any:
        """A Guard over the copies: the run's precision and clipping, the schedulers stepped on
        applied windows, the loss scale where the replay is; no recorder, no audit."""
        from ampguard.guard._guard import Guard  # the class this package defines

        g = Guard(
            self.model,
            self.optimizers,
            precision=self.guard.precision,
            clip_grad_norm=self.guard.clip_grad_norm,
            audit_every=None,
            flight_recorder=False,
            on_spike=None,
            snapshot=False,
        )
        for sched in self.schedulers:
            g.on_applied(_stepper(sched))
        if self.scale is not None and g.loss_scaler is not None:
            g.loss_scaler.scale_tensor.copy_(self.scale)
        return g

    def window(
        self,
        g: Any,
        step: int,
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
        train: bool = True,
    ) -> float:
        batch, loss_fn = self.watch.batches[step]
        with g.autocast():
            loss = loss_fn(self.model, batch)
        value = float(loss.detach().float())
        if not train:
            return value
        g.backward(loss)
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
        snap.restore(self.model, self.optimizers, self.schedulers)
        self.scale = None if snap.scale is None else snap.scale["scale"].clone()


def _stepper(sched: Any) -> Callable[[Any], None]:
    def step(_result: Any) -> None:
        sched.step()

    return step


class NotApplicable(Exception):
    """An intervention that does not apply to this run (the reason is the message)."""


Run = Callable[[], float]


def plain(rep: Replay, step: int) -> tuple[float, dict[str, float]]:
    """Windows t - 1 and t plainly: the loss at t and the update ratios at t - 1."""
    g = rep.new_guard()
    params = dict(rep.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    rep.window(g, step - 1)
    ratios = {
        n: float((p.detach() - before[n]).norm() / before[n].norm().clamp_min(1e-30))
        for n, p in params.items()
    }
    return rep.window(g, step, train=False), ratios


def interventions(
    rep: Replay, step: int, suspect: str | None, ratios: dict[str, float]
) -> list[tuple[str, Run]]:
    params = dict(rep.model.named_parameters())
    layer_params = [n for n in params if suspect is not None and layer_of(n) == suspect]

    def drop_outliers() -> float:
        g = rep.new_guard()
        rep.window(g, step - 1)
        batch, loss_fn = rep.watch.batches[step]
        n = _batch_len(batch)
        if n is None or n < 2:
            raise NotApplicable("the batch cannot be split by sample")
        with torch.no_grad(), g.autocast():
            per = [float(loss_fn(rep.model, _index(batch, [i]))) for i in range(n)]
        median = sorted(per)[n // 2]
        k = min(max(1, sum(v > 3 * median for v in per)), max(1, n // 4))  # the outliers
        keep = sorted(range(n), key=lambda i: per[i])[: n - k]
        with torch.no_grad(), g.autocast():
            return float(loss_fn(rep.model, _index(batch, keep)))

    def floor_v() -> float:
        g = rep.new_guard()

        def floor() -> None:
            hit = False
            for opt in rep.optimizers:
                for name in layer_params:
                    st = opt.state.get(params[name], {})
                    v = st.get("exp_avg_sq")
                    if isinstance(v, torch.Tensor) and v.numel():
                        v.clamp_(min=float(v.float().mean()))
                        hit = True
            if not hit:
                raise NotApplicable("the suspect layer has no Adam second moment")

        rep.window(g, step - 1, before=floor)
        return rep.window(g, step, train=False)

    def clip_update() -> float:
        g = rep.new_guard()
        others = sorted(v for n, v in ratios.items() if n not in layer_params)
        median = others[len(others) // 2] if others else 0.0  # the other layers' median
        before = {n: params[n].detach().clone() for n in layer_params}

        def clip() -> None:
            with torch.no_grad():
                for n in layer_params:
                    delta = params[n] - before[n]
                    cap = median * float(before[n].norm())
                    norm = float(delta.norm())
                    if norm > cap > 0:
                        params[n].copy_(before[n] + delta * (cap / norm))

        if not layer_params:
            raise NotApplicable("no suspect layer")
        rep.window(g, step - 1, after=clip)
        return rep.window(g, step, train=False)

    def fp32_layer() -> float:
        if suspect is None or rep.guard.policy.entry.is_full:
            raise NotApplicable("the run is fp32 already" if suspect else "no suspect layer")
        g = rep.new_guard()
        with Fp32Islands(rep.model) as islands:  # the hooks go when the block ends
            if suspect not in dict(rep.model.named_modules()):
                raise NotApplicable(f"{suspect!r} is a parameter of no submodule")
            islands.add(suspect)
            rep.window(g, step - 1)
            return rep.window(g, step, train=False)

    def halve_lr() -> float:
        g = rep.new_guard()
        groups = [grp for opt in rep.optimizers for grp in opt.param_groups]
        lrs: list[float] = []

        def half() -> None:  # after the recorded LRs are set
            lrs[:] = [grp["lr"] for grp in groups]
            for grp in groups:
                grp["lr"] *= 0.5

        def back() -> None:
            for grp, lr in zip(groups, lrs, strict=True):
                grp["lr"] = lr

        rep.window(g, step - 1, before=half, after=back)
        return rep.window(g, step, train=False)

    return [
        ("drop_outliers", drop_outliers),
        ("floor_v", floor_v),
        ("clip_update", clip_update),
        ("fp32_layer", fp32_layer),
        ("halve_lr", halve_lr),
    ]


def _batch_len(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)) and batch:
        sizes = {_batch_len(b) for b in batch}
        return sizes.pop() if len(sizes) == 1 else None
    if isinstance(batch, dict) and batch:
        sizes = {_batch_len(b) for b in batch.values()}
        return sizes.pop() if len(sizes) == 1 else None
    return None


def _index(batch: Any, idx: list[int]) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[torch.tensor(idx, device=batch.device)]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_index(b, idx) for b in batch)
    if isinstance(batch, dict):
        return {k: _index(v, idx) for k, v in batch.items()}
    return batch
