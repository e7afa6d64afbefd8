"""The replays ``ampguard.triage`` runs of a failed step, and how one is compared with its record.

* :func:`run`: the step at its precision and loss scale with its signatures recorded (a
  :class:`SignatureRecorder`), and either every leaf's inputs, outputs and gradients copied
  (``capture``: the reference check reads them) or only which leaf first output a NaN/inf
  (``watch``: a step whose failure its batch or weights already explain needs no reference
  check, only that name);
* :func:`fp32_failed`: the fp32 replay, which only has to say whether the step still fails
  (its loss, or a gradient, NaN/inf): no signatures, no copies;
* :func:`explained`: whether the batch or the weights already hold a NaN/inf;
* :func:`compare`: where a replay parts from the record (:func:`first_difference`; a step the
  recorder sampled out, on its loss alone).
"""

from __future__ import annotations

import math
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ampguard.core.policy import PrecisionPolicy
from ampguard.forensics._faultcheck import Captures, floats
from ampguard.forensics._signatures import SignatureRecorder, StepSignature, first_difference

__all__ = ["Replayed", "compare", "explained", "first_bad_module", "fp32_failed", "run"]


@dataclass
class Replayed:
    """What one replay saw: its signatures, whether it failed, its loss, and the leaves'
    copies (``capture``) or the first leaf whose output held a NaN/inf (``watch``)."""

    signature: StepSignature
    bad: bool
    loss: float
    captures: Captures | None
    first_bad: str | None = None


class _Watch:
    """Forward hooks on every leaf noting, on its first call, whether its output is finite
    (a device flag each; read once). Cost: two small kernels per leaf, one host sync."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.flags: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        leaves = [(n, m) for n, m in model.named_modules() if not any(m.children())]
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in leaves]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_m: Any, _args: Any, out: Any) -> None:
            if name not in self.flags:  # a module called twice: its first call, as Captures
                self.order.append(name)
                ts = floats(out)
                self.flags[name] = (
                    torch.stack([torch.isfinite(t).all() for t in ts]).all()
                    if ts
                    else torch.ones((), dtype=torch.bool)
                )

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def first_bad(self) -> str | None:
        if not self.order:
            return None
        device = self.flags[self.order[0]].device
        fine = torch.stack([self.flags[n].to(device) for n in self.order]).tolist()
        return next((n for n, ok in zip(self.order, fine, strict=True) if not ok), None)


def run(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    policy: PrecisionPolicy,
    scale: float,
    capture: bool,
    watch: bool = False,
) -> Replayed:
    """One forward+backward of ``loss * scale`` under ``policy``, signatures recorded; with
    ``capture`` every leaf's inputs, outputs and gradients copied, with ``watch`` only the
    first leaf output holding a NaN/inf noted. Cost: the step, its signatures' hooks and
    reductions, the copies; a few host syncs."""
    recorder = SignatureRecorder(model, capacity=1)
    captures = Captures(model) if capture else None
    watcher = _Watch(model) if watch and not capture else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # full backward hooks where no input needs grad
            with policy.autocast():
                loss = loss_fn(model, batch)
            (loss.float() * scale).backward()
    finally:
        recorder.remove()
        if captures is not None:
            captures.remove()
        if watcher is not None:
            watcher.remove()
    sig = recorder.read(recorder.steps[-1])
    loss_value = float(loss.detach().float())
    bad = sig.bad or not math.isfinite(loss_value)
    first = watcher.first_bad() if watcher is not None else None
    return Replayed(sig, bool(bad), loss_value, captures, first)


def fp32_failed(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    policy: PrecisionPolicy,
) -> tuple[bool, float]:
    """``(failed, loss)`` of one forward+backward under ``policy`` (fp32) at scale 1: failed
    when the loss or a trainable parameter's gradient norm (the recorder's own test: its L2
    norm, one ``_foreach_norm``) is NaN/inf. Cost: the step and one host sync."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with policy.autocast():
            loss = loss_fn(model, batch)
        loss.float().backward()
    grads = [p.grad.detach() for p in model.parameters() if p.requires_grad and p.grad is not None]
    parts = [loss.detach().float().reshape(1)]
    if grads:
        device = parts[0].device
        parts += [n.float().reshape(1).to(device) for n in torch._foreach_norm(grads)]
    values = torch.cat(parts)
    return not bool(torch.isfinite(values).all()), float(values[0])


def explained(model: torch.nn.Module, batch: Any) -> str | None:
    """What already holds a NaN/inf before any op runs: ``"batch"`` (a floating tensor of it,
    found as :func:`~ampguard.forensics._replay.nonfinite_leaves` walks it), ``"weights"`` (a
    parameter or buffer), or None. Cost: one ``_foreach_norm`` (max |x|) over them all, one
    host sync."""
    inputs = _batch_floats(batch)
    state = [
        t.detach()
        for t in (*model.parameters(), *model.buffers())
        if t.is_floating_point() and t.numel()
    ]
    tensors = inputs + state
    if not tensors:
        return None
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    home = tensors[0].device
    peaks: list[torch.Tensor] = [torch.empty(())] * len(tensors)
    for idx in groups.values():  # a foreach per device (the batch may sit elsewhere)
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], math.inf), strict=True):
            peaks[i] = n.float().to(home)
    fine = torch.isfinite(torch.stack(peaks)).tolist()
    if not all(fine[: len(inputs)]):
        return "batch"
    return None if all(fine[len(inputs) :]) else "weights"


def _batch_floats(batch: Any) -> list[torch.Tensor]:
    """The non-empty floating tensors of ``batch`` (tensors, lists, tuples, dicts)."""
    if isinstance(batch, torch.Tensor):
        return [batch.detach()] if batch.is_floating_point() and batch.numel() else []
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _batch_floats(item)]
    if isinstance(batch, dict):
        return [t for item in batch.values() for t in _batch_floats(item)]
    return []


def compare(recorded: StepSignature, low: Replayed) -> tuple[str, str | None, str] | None:
    """Where the replay parts from the record; a step the recorder sampled out is compared
    on its loss alone (the flight recorder's fp32 value; None: it was NaN/inf)."""
    if recorded.complete:
        return first_difference(recorded, low.signature)
    finite = math.isfinite(low.loss)
    if recorded.loss is None:
        same = not finite
    else:
        same = finite and struct.pack("<f", recorded.loss) == struct.pack("<f", low.loss)
    return None if same else ("forward", None, "the loss (the step's signatures were sampled out)")


def first_bad_module(run: Replayed) -> str | None:
    """The first leaf (forward order) whose output held a NaN/inf in ``run``."""
    if run.captures is None:
        return run.first_bad
    for name in run.captures.order:
        out = run.captures.caps[name].output
        if any(not bool(torch.isfinite(t).all()) for t in floats(out)):
            return name
    return None
