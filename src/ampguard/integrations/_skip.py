"""How attach mode keeps a spiked step out of the weights, where the framework lets it.

A watched loop owns its optimizer step, so ``on_spike="skip"`` acts through what the step
already consults:

* **a ``torch.amp.GradScaler``** (plain loops, HF Trainer and Accelerate under fp16,
  Lightning's ``16-mixed``): the spike flag is added to the scaler's own ``found_inf`` for the
  optimizer (:func:`fold`), so the scaler skips the step exactly as for an overflow: no extra host
  sync (its own ``.item()`` reads it), and a fused optimizer's kernel skips on it
  (``optimizer.found_inf``). The flag is taken out again before ``scaler.update()``
  (:func:`unfold`), so a spike does not back the scale off. Accelerate then reports
  ``optimizer_step_was_skipped`` and its (and the HF Trainer's) LR scheduler does not advance;
  Lightning steps its schedulers whatever the scaler did.
* **no scaler** (bf16/fp32): the optimizer's ``step`` is wrapped on the instance
  (:func:`wrap_step`); the wrapper reads the window's flag on the host (one host sync per
  optimizer step, the one ``Guard.step()`` makes there too) and does not call the step when it
  is set. A fused optimizer (``AdamW(fused=True)``...) is stepped with the flag as its
  ``found_inf`` instead, as ``GradScaler`` hands it one: its kernel skips on the device, no host
  sync (the framework then sees a step it cannot tell was skipped, as for fused overflows).
  A closure (Lightning runs forward and backward inside ``optimizer.step(closure)``) is
  evaluated first, once, and handed to the step as its result, so optimizers that evaluate their
  closure once (SGD, Adam, AdamW...) step exactly as before; ``torch.optim.LBFGS``, which calls
  it repeatedly, is not wrapped (its spikes warn).
* **DeepSpeed**: ``engine.step()`` applies the update from its own flat gradient buffers and
  decides overflow itself, with no flag ampguard can set: a spike warns instead (see
  :mod:`ampguard.integrations._recorder`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ampguard._util.tensors import is_fused

__all__ = ["CANNOT_SKIP", "SkipSteps", "cannot_skip", "fold", "unfold", "wrap_step"]

_MISSING = object()

CANNOT_SKIP = {
    "deepspeed": (
        "DeepSpeed's engine.step() applies the update from its own flat gradient buffers and "
        "decides its overflow skip itself, with no flag ampguard can set"
    ),
}


def fold(scaler: Any, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> Any:
    """Make ``scaler.step(optimizer)`` (about to run) skip when the 0-dim ``flag`` is set;
    returns what :func:`unfold` takes after the step. Cost: one or two device ops, no sync."""
    if is_fused(optimizer):
        # GradScaler hands a fused optimizer its found_inf as an attribute right before the
        # step: the pre-hook adds the flag there (found_inf_per_device stays the overflow's)
        def add(opt: Any, args: Any, kwargs: Any) -> None:
            found = getattr(opt, "found_inf", None)
            if isinstance(found, torch.Tensor):
                opt.found_inf = found + flag.to(found)

        return optimizer.register_step_pre_hook(add)
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"].name == "READY":
        scaler.unscale_(optimizer)  # what step() does first (through the watch's wrapper)
    found = next(iter(state["found_inf_per_device"].values()))
    found.add_(flag.to(found))
    return found, flag


def unfold(folded: Any) -> None:
    """Undo :func:`fold` once the step ran: the scaler's update sees the overflow alone."""
    if isinstance(folded, tuple):
        found, flag = folded
        found.sub_(flag.to(found))
    else:
        folded.remove()


def wrap_step(
    optimizer: torch.optim.Optimizer,
    skip: Callable[[], bool],
    skipped: Callable[[], None],
    flag: Callable[[], torch.Tensor | None],
) -> Callable[[], None]:
    """Wrap ``optimizer.step`` on the instance: ``skip()`` (after a closure ran; a host read)
    says whether this step is left out, then ``skipped()`` records it; a fused optimizer gets
    ``flag()`` (the device flag) as its ``found_inf`` instead. Returns the undo (the instance's
    previous ``step`` attribute comes back: an LR scheduler's wrapper stays)."""
    fused = is_fused(optimizer)
    previous = optimizer.__dict__.get("step", _MISSING)
    original: Callable[..., Any] = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        closure = None
        if "closure" in kwargs:
            closure = kwargs.pop("closure")
        elif args:
            closure, args = args[0], args[1:]
        loss = None
        if closure is not None:  # forward and backward run here (Lightning)
            with torch.enable_grad():
                loss = closure()
        run = (
            (lambda: original(*args, **kwargs))
            if closure is None
            else (lambda: original(lambda: loss, *args, **kwargs))
        )
        if fused:  # the kernel skips on found_inf, on the device (GradScaler's contract)
            found = flag()
            if found is None or getattr(optimizer, "found_inf", None) is not None:
                return run()
            optimizer.found_inf = found  # type: ignore[attr-defined]
            try:
                return run()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        if skip():
            skipped()
            return loss
        return run()

    functools.update_wrapper(step, original)  # keeps an LR scheduler's mark on the step
    optimizer.__dict__["step"] = step

    def undo() -> None:
        if optimizer.__dict__.get("step") is step:
            if previous is _MISSING:
                del optimizer.__dict__["step"]
            else:
                optimizer.__dict__["step"] = previous

    return undo


def cannot_skip(watched: Any, optimizers: list[Any]) -> str | None:
    """Why a spiked step of this loop cannot be skipped (None: it can, see
    :mod:`ampguard.integrations._skip`)."""
    if watched is not None:
        return getattr(
            watched, "cannot_skip", f"{watched.name} gives ampguard no flag to skip its step"
        )
    if any(isinstance(o, torch.optim.LBFGS) for o in optimizers):
        return "torch.optim.LBFGS evaluates its closure several times per step"
    return None


class SkipSteps:
    """The Watch's side of a scaler-free step skipped for a loss spike (a mixin of the Watch:
    :func:`wrap_step` calls ``_decide`` and ``_skipped``)."""

    recorder: Any
    source: Any
    _closed: bool
    _done: int
    _skipped_window: int
    _record_step: Callable[..., None]  # the Watch's

    def _decide(self) -> bool:
        """A scaler-free step is about to run: skip it on a loss spike. Cost: one host sync."""
        assert self.recorder is not None
        self.recorder.begin(self._done + 1)
        return not self._closed and self.recorder.decide(self._done + 1)

    def _flag_now(self) -> torch.Tensor | None:
        """The device flag that skips this scaler-free step (a fused optimizer's found_inf)."""
        assert self.recorder is not None
        self.recorder.begin(self._done + 1)
        return None if self._closed else self.recorder.skip_flag(self._done + 1)

    def _skipped(self) -> None:
        """The scaler-free step was skipped for the spike: record it (its post-hook won't)."""
        if self._skipped_window != self._done + 1:  # once per window (several optimizers)
            self._skipped_window = self._done + 1
            self._record_step(torch.zeros((), device=self.source.device))

    @property
    def spike_skipped_last(self) -> bool:
        """The last step recorded was a scaler-free step skipped for a loss spike (host bool,
        no sync)."""
        return self._skipped_window == self._done and self._done > 0
