"""Argument checks for :class:`ampguard.Guard`: clear errors at construction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from ampguard._util.checks import check_bool, check_int, is_number

__all__ = [
    "as_optimizers",
    "check_window",
    "check_model",
    "check_backward",
    "check_grads_present",
    "check_flag",
    "scheduler_callback",
]


def as_optimizers(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
) -> list[torch.optim.Optimizer]:
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not opts:
        raise ValueError("optimizer must be an optimizer or a non-empty list of optimizers")
    for opt in opts:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a list of them, got "
                f"{type(opt).__name__}"
            )
    if len({id(o) for o in opts}) != len(opts):
        raise ValueError("optimizer lists the same optimizer twice")
    return cast("list[torch.optim.Optimizer]", opts)  # each one checked above


def check_window(accumulation_steps: Any, clip_grad_norm: Any) -> None:
    check_int("accumulation_steps", accumulation_steps)
    if clip_grad_norm is not None and (not is_number(clip_grad_norm) or not clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm must be None or a number > 0, got {clip_grad_norm!r}")


def scheduler_callback(sched: Any) -> Callable[[Any], Any]:
    if not callable(getattr(sched, "step", None)):
        raise TypeError(f"schedulers must have a .step() method, got {type(sched).__name__}")
    return lambda _result: sched.step()


def check_model(model: Any, params: list[torch.Tensor]) -> None:
    """``model`` must be a module with parameters; the optimizers must hold some."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if next(iter(model.parameters()), None) is None:
        raise ValueError(
            "model has no parameters: ampguard needs at least one trainable "
            "tensor (pass the module that owns the optimizer's parameters)"
        )
    if not params:
        raise ValueError("optimizer has no parameters to train (its param_groups are empty)")
    owned = {id(p) for p in model.parameters()}
    foreign = [(i, p) for i, p in enumerate(params) if id(p) not in owned]
    if foreign:
        named = ", ".join(f"#{i} (shape {tuple(p.shape)})" for i, p in foreign[:3])
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise ValueError(
            f"{len(foreign)} of the optimizer's {len(params)} parameters are not parameters of "
            f"model ({type(model).__name__}): {named}{more} (counted over all param_groups). "
            "The Guard would step tensors the model never uses; build the optimizer from this "
            "model's parameters (e.g. torch.optim.AdamW(model.parameters())) or pass the model "
            "it was built for."
        )


def check_backward(micro: int, accumulation_steps: int) -> None:
    """Before a backward: the window must have room for one more micro-batch."""
    if micro >= accumulation_steps:
        raise RuntimeError(
            f"Guard.backward() called {micro + 1} times in one window, but accumulation_steps="
            f"{accumulation_steps}: the gradients would add up into a "
            f"{(micro + 1) / accumulation_steps:g}x larger update. Call guard.step() after each "
            f"guard.backward(loss), or pass accumulation_steps={micro + 1} (or more) to "
            "accumulate that many micro-batches per optimizer step."
        )


def check_grads_present(params: list[torch.Tensor]) -> None:
    """At the end of a window (after at least one backward): some parameter has a gradient.

    Every gradient being None means something cleared them between ``guard.backward()`` and
    ``guard.step()``: typically a second Guard on the same model whose window overlaps this one
    (its ``step()`` zeroes the gradients with ``set_to_none``), or an ``optimizer.zero_grad()``
    in between. Stepping would apply nothing yet report ``applied=True``, so it is an error.
    Cost: no host sync; stops at the first parameter with a gradient (one check when healthy).
    """
    if any(p.grad is not None for p in params):
        return
    raise RuntimeError(
        "Guard.step(): guard.backward() ran in this window, but every gradient of the Guard's "
        "optimizers is None now: something cleared them before step(), so there is nothing to "
        "apply (the window is discarded). Typically a second Guard on the same model stepped "
        "in between (its step() clears the gradients), or optimizer.zero_grad() ran between "
        "backward() and step(). Use one Guard per model and optimizer, or finish one Guard's "
        "window (backward, step) before the other's backward."
    )


def check_flag(name: str, value: Any) -> bool:
    return check_bool(name, value)
