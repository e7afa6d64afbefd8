"""Replay one training step of a batch under a precision, traced, and leave the model as it was.

``locate`` runs the same batch several times (low precision at the loss scale, fp32, low precision
at scale 1); every run starts from the same parameters, buffers, RNG state and training modes,
and :class:`Preserved` puts all of them, and the gradients, back afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.core.policy import PrecisionPolicy
from ampguard.forensics._optrace import OpEvent, OpTrace

__all__ = ["Preserved", "Run", "replay", "nonfinite_leaves", "rng_state"]


class Preserved:
    """Snapshot of a model's parameters, buffers, grads, RNG and modes; :meth:`reset` restores
    the values for the next run, :meth:`close` restores everything and drops the copies.

    Cost: holds one copy of the parameters and buffers while open.
    """

    def __init__(self, model: torch.nn.Module, rng: dict[str, Any] | None = None) -> None:
        self.model = model
        self._slots: list[tuple[dict, str, torch.Tensor, torch.Tensor]] = []
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for key, value in store.items():
                    if value is not None:
                        self._slots.append((store, key, value, value.detach().clone()))
        self._grads = [(p, p.grad) for p in model.parameters()]
        self._modes = [(m, m.training) for m in model.modules()]
        self._device_type = next((p.device.type for p in model.parameters()), "cpu")
        self._rng = _rng_state(self._device_type)
        # the replays start from ``rng`` (the failing step's, so dropout draws the same mask);
        # close() puts back the RNG as it was when the snapshot was taken
        self._replay_rng = self._rng if rng is None else rng

    def reset(self) -> None:
        """Values, modes and RNG (the replay's: ``rng`` if given) as at the snapshot; gradients
        cleared (``None``)."""
        with torch.no_grad():
            # always copy back: kernels update buffers (BatchNorm stats) without a version bump
            for store, key, original, copy in self._slots:
                store[key] = original
                original.copy_(copy)
        for p, _ in self._grads:
            p.grad = None
        for m, mode in self._modes:
            m.training = mode
        _set_rng_state(self._device_type, self._replay_rng)

    def close(self) -> None:
        """Restore everything, gradients and the caller's RNG included, and free the copies."""
        self.reset()
        _set_rng_state(self._device_type, self._rng)
        for p, grad in self._grads:
            p.grad = grad
        self._slots.clear()


@dataclass
class Run:
    """What one traced replay saw."""

    precision: str
    scale: float
    events: list[OpEvent]
    stats: list[list[float]]
    loss: float
    grads: dict[str, float] = field(default_factory=dict)  # name -> max |grad| (nan/inf kept)
    order: list[str] = field(default_factory=list)  # parameters in accumulation order
    entered: dict[str, bool] = field(default_factory=dict)  # module -> autocast on at entry
    # name -> the gradient itself (detached; the model's .grad is reset after the run)
    grad_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    emulated: list[str] = field(default_factory=list)  # Linear layers in a low-precision format

    @property
    def failed(self) -> bool:
        """The loss or any gradient is non-finite."""
        values = [self.loss, *self.grads.values()]
        return any(not math.isfinite(v) for v in values)

    def row(self, event: OpEvent) -> list[float] | None:
        return None if event.row is None else self.stats[event.row]


def replay(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    batch: Any,
    policy: PrecisionPolicy,
    scale: float,
    *,
    numerics: bool = True,
) -> Run:
    """Forward ``loss_fn(model, batch)`` under ``policy``'s autocast, backward of ``loss * scale``
    (as GradScaler does), all traced. Cost: one host sync at the end (plus the loss check); the
    run keeps a reference to every gradient (one gradient's worth of memory per run held)."""
    trace = OpTrace(model, numerics=numerics, hunt="all")
    names = {id(p): n for n, p in model.named_parameters()}
    order: list[str] = []
    hooks = [
        p.register_post_accumulate_grad_hook(lambda t: order.append(names[id(t)]))
        for p in model.parameters()
        if p.requires_grad
    ]
    try:
        with policy.autocast(), trace.session("forward"):
            loss = loss_fn(model, batch)
        loss = _check_loss(loss)
        scale_t = torch.full((), scale, dtype=torch.float32, device=loss.device)
        with trace.session("backward"):
            (loss * scale_t).backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    values = torch.stack(
        [loss.detach().float().reshape(())]
        + [g.detach().abs().amax().float().to(loss.device) for g in grads.values()]
    ).tolist()
    return Run(
        policy.precision,
        scale,
        trace.events,
        trace.stats(),
        values[0],
        dict(zip(grads, values[1:], strict=True)),
        order,
        trace.autocast_on_entry,
        {n: g.detach() for n, g in grads.items()},
    )


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a single-element loss, got shape {tuple(loss.shape)}"
        )
    if not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not require grad: it must depend on "
            "the model's trainable parameters"
        )
    return loss


def nonfinite_leaves(batch: Any, path: str = "batch") -> list[dict[str, Any]]:
    """Floating tensors in ``batch`` holding NaN/inf: ``[{path, nan, inf, dtype, shape}]``.

    Cost: one host sync per floating tensor in the batch.
    """
    found: list[dict[str, Any]] = []
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point() and batch.numel():
            nan, inf = (int(v) for v in torch.stack([batch.isnan().sum(), batch.isinf().sum()]))
            if nan or inf:
                found.append(
                    {
                        "path": path,
                        "nan": nan,
                        "inf": inf,
                        "dtype": str(batch.dtype),
                        "shape": list(batch.shape),
                    }
                )
    elif isinstance(batch, (list, tuple)):
        for i, item in enumerate(batch):
            found += nonfinite_leaves(item, f"{path}[{i}]")
    elif isinstance(batch, dict):
        for key, item in batch.items():
            found += nonfinite_leaves(item, f"{path}[{key!r}]")
    return found


def rng_state(device_type: str) -> dict[str, Any]:
    """The global RNG state a replay can start from: ``{"cpu": ...}`` plus the accelerator's
    (``"cuda": [...]``, every device) where ``device_type`` has one. Cost: host copies of the
    generator states, no device sync."""
    return _rng_state(device_type)


def _rng_state(device_type: str) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    mod = getattr(torch, device_type, None) if device_type != "cpu" else None
    if mod is not None and hasattr(mod, "get_rng_state_all"):
        state[device_type] = mod.get_rng_state_all()
    return state


def _set_rng_state(device_type: str, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if device_type != "cpu" and device_type in state:
        getattr(torch, device_type).set_rng_state_all(state[device_type])
