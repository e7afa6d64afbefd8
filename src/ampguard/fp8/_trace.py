"""The plan's trace: one bf16 forward and backward of ``loss_fn(model, batch)`` that captures
every Linear's input and output gradient and leaves the model as it was.

The backward asks autograd for the gradients of the Linear outputs only
(``torch.autograd.grad`` with their gradient edges as inputs), so it computes no weight
gradient: about 60% of a training step's backward on a model of Linear layers. The gradient of
an output is the one its layer saw when it ran, even when a later op modifies it in place
(``nn.ReLU(inplace=True)``): the edge is taken when the layer returns. Gradients, buffers, RNG
state and training modes are as before afterwards, and no hook is left behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampguard.core.policy import device_of

__all__ = ["check_batch", "trace"]


def _tensors(batch: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``batch`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif depth < 8 and isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _tensors(item, depth + 1)
    elif depth < 8 and isinstance(batch, dict):
        for item in batch.values():
            yield from _tensors(item, depth + 1)


def check_batch(batch: Any) -> None:
    """``ValueError`` naming ``batch`` when a tensor of it is empty or not finite."""
    for i, t in enumerate(_tensors(batch)):
        what = "batch" if isinstance(batch, torch.Tensor) else f"batch (tensor {i})"
        if t.numel() == 0 or (t.dim() > 0 and t.shape[0] == 0):
            raise ValueError(
                f"{what} has 0 rows (shape {tuple(t.shape)}): the plan measures each Linear "
                "on one real batch; pass one with at least one sample"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"the batch is not finite: {what} holds NaN or inf values; the plan would "
                "measure the bad values, not the layers. Pass a batch of real data"
            )


@contextlib.contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Leave gradients, buffers and the RNG state as they were (the trace is not a step)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    for p in params:
        p.grad = None
    devices = [p.device for p in params if p.device.type == "cuda"][:1]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])


def _edge(t: torch.Tensor) -> Any:
    """The gradient edge of ``t`` (what ``torch.autograd.grad`` accepts as an input and keeps
    pointing at this version of ``t``); ``t`` itself on a torch without edges."""
    get_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    return t if get_edge is None else get_edge(t)


def trace(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    linears: dict[str, nn.Linear],
) -> dict[str, dict[str, torch.Tensor]]:
    """``{name: {"x": input, "g": output gradient}}`` for every Linear the forward called, in
    the order they ran (``"g"`` absent when no gradient reached the layer); a layer called twice
    is measured on its first call. Cost: one forward in bf16 autocast and the backward to the
    Linear outputs (no weight gradient); no host sync beyond the loss check."""
    captured: dict[str, dict[str, torch.Tensor]] = {}
    outputs: list[tuple[str, Any]] = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if name in captured or not args or not isinstance(args[0], torch.Tensor):
                return
            captured[name] = {"x": args[0].detach()}
            if isinstance(out, torch.Tensor) and out.requires_grad:
                outputs.append((name, _edge(out)))

        return hook

    device_type = device_of(model.parameters()).type
    with _preserved(model):
        handles = [m.register_forward_hook(hook_for(n)) for n, m in linears.items()]
        try:
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
        finally:
            for h in handles:
                h.remove()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn(model, batch) must return a single-element tensor")
        if loss.requires_grad and outputs:
            grads = torch.autograd.grad(loss.float(), [e for _, e in outputs], allow_unused=True)
            for (name, _), g in zip(outputs, grads, strict=True):
                if g is not None:
                    captured[name]["g"] = g.detach()
    return captured
