"""Replay one training step of a batch under a precision, traced, and leave the model as it was.

``locate`` runs the same batch several times (low precision at the loss scale, fp32, low precision
at scale 1); every run starts from the same parameters, buffers, RNG state and training modes,
and :class:`~ampguard.replay.Preserved` (the one replay engine's, :mod:`ampguard.replay`) puts all
of them, and the gradients, back afterwards; ``Preserved`` and ``rng_state`` are re-exported here
for the modules that import them from this one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.core.policy import PrecisionPolicy
from ampguard.forensics._optrace import OpEvent, OpTrace
from ampguard.replay import Preserved, rng_state

__all__ = ["Preserved", "Run", "replay", "nonfinite_leaves", "rng_state"]


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
