"""``ampguard.triage`` on an attached run: what each framework lets it replay.

``ag.triage(handle)`` reads a :class:`~ampguard.integrations.watch.Watch` as it reads a Guard
(``signatures``, ``flight_recorder``, ``model``, ``steps``, ``precision``, ``scale_used_at``,
``telemetry``). A replay needs the failed step's signatures (``signatures=True``) and its batch
with a ``loss_fn(model, batch)``:

* the **HF Trainer** callback takes the batch from the model's forward (the keyword arguments
  ``Trainer.training_step`` calls it with) and replays ``model(**batch).loss``;
* the **Lightning** callback takes the batch from ``on_train_batch_start`` and replays
  ``training_step(batch, 0)``; a step's signatures start at the module's own forward, so the
  ``training_step`` must call the module (``self(x)``), as Lightning's examples do;
* **plain loops and Accelerate** own their forward: the loop hands each batch to
  ``handle.record_batch(batch, loss_fn)``;
* **DeepSpeed** owns the forward of a converted (fp16/bf16) and partitioned module, so no step
  can be replayed outside the engine: triage is not available there.

Where something is missing, reading ``handle.signatures`` (the first thing ``triage`` reads)
raises one ``ValueError`` saying what and how to get it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ampguard.forensics import SignatureRecorder
from ampguard.guard import SpikeWatch

__all__ = ["HFLoss", "NO_REPLAY", "TriageSurface", "hf_loss", "lightning_loss", "signatures_of"]

NO_REPLAY = {
    "deepspeed": (
        "DeepSpeed's engine owns the forward of a converted (fp16/bf16) and partitioned module, "
        "so ampguard cannot replay a step outside it"
    ),
}

_HOW = {
    "transformers": "AmpGuardCallback(signatures=True)",
    "lightning": "AmpGuardCallback(signatures=True)",
    "accelerate": "watch_accelerator(..., signatures=True)",
}


def signatures_of(handle: Any, recorder: Any, batches: int) -> Any:
    """``recorder`` when ``ag.triage(handle)`` can replay the run, else the ``ValueError``."""
    framework = handle.framework or "plain"
    if framework in NO_REPLAY:
        raise ValueError(
            f"ag.triage is not available on an attached {framework} run: {NO_REPLAY[framework]}"
        )
    if handle.recorder is None:
        raise ValueError(
            "ag.triage needs the flight recorder, which keeps the failed step's batch: attach "
            "without flight_recorder=False / on_spike=None"
        )
    if recorder is None:
        how = _HOW.get(framework, "ag.watch(..., signatures=True)")
        raise ValueError(
            f"ag.triage needs the step's signatures: attach with {how} (and flight_recorder on, "
            "the default)"
        )
    if batches == 0:
        where = (
            "the loop must hand each batch to handle.record_batch(batch, loss_fn) before its "
            "forward"
            if framework not in ("transformers", "lightning")
            else f"no training batch reached the {framework} callback"
        )
        raise ValueError(
            f"ag.triage needs the failed step's batch to replay it, and {framework} does not "
            f"hand it to ampguard: {where}"
        )
    if not recorder.steps:
        raise ValueError(
            f"ag.triage found no recorded step on this {framework} run: a step's signatures "
            "start at the model's own forward, and none ran"
            + (
                " (the LightningModule's training_step must call the module, self(x), not only "
                "its submodules)"
                if framework == "lightning"
                else ""
            )
        )
    return recorder


def hf_loss(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The HF Trainer's default loss: ``model(**batch).loss``."""
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError("the model's output has no loss (give the batch labels)")
    return loss


class HFLoss:
    """The HF Trainer's loss when it hands the model ``num_items_in_batch`` (the divisor of the
    loss's sum, counted over the whole batch): ``model(**batch, num_items_in_batch=n * k / N)``
    for a batch of ``k`` of the recorded ``N`` samples (the recorded loss exactly for the whole
    batch; a replay that drops samples divides by their share)."""

    def __init__(self, items: Any, batch: Mapping[str, Any]) -> None:
        self.items, self.size = items, _rows(batch)

    def __call__(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        rows = _rows(batch)
        items = self.items
        if rows is not None and self.size and rows != self.size:
            items = items * rows / self.size
        return hf_loss(model, {**batch, "num_items_in_batch": items})


def _rows(batch: Mapping[str, Any]) -> int | None:
    """The samples of a keyword batch (its first tensor's leading size)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    return None


def lightning_loss(module: Any, batch: Any) -> torch.Tensor:
    """A LightningModule's ``training_step(batch, 0)`` loss (a tensor, or a dict's ``loss``)."""
    out = module.training_step(batch, 0)
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError("training_step returned no loss tensor")
    return loss


class TriageSurface:
    """What ``ampguard.triage`` reads of a :class:`~ampguard.integrations.watch.Watch` besides
    ``steps``, ``precision`` and ``telemetry`` (a mixin of the Watch: it reads the Watch's
    own state)."""

    source: Any
    recorder: Any
    framework: str | None
    _signatures: SignatureRecorder | None
    _batches: int
    _closed: bool
    _done: int

    @property
    def model(self) -> torch.nn.Module:
        """The watched model."""
        return self.source.model

    @property
    def flight_recorder(self) -> SpikeWatch | None:
        """The Guard's flight recorder on this loop (``.ring``, ``.events``, ``.snapshots``);
        None with ``flight_recorder=False`` and ``on_spike=None``."""
        return None if self.recorder is None else self.recorder.spikes

    @property
    def signatures(self) -> SignatureRecorder:
        """The step signatures ``ampguard.triage(handle)`` compares its replays with.
        ``ValueError`` saying what is missing: ``signatures=True``, or the batches (which only
        the HF Trainer and Lightning callbacks take themselves)."""
        return signatures_of(self, self._signatures, self._batches)

    def record_batch(self, batch: Any, loss_fn: Callable[[torch.nn.Module, Any], Any]) -> None:
        """Keep this step's ``batch`` and ``loss_fn(model, batch)`` (the scalar loss) for
        ``ampguard.triage(handle)``: call it before the forward, in a loop whose framework does
        not hand ampguard the batch (plain loops, Accelerate). Cost: a reference, no copy."""
        if self.recorder is not None and not self._closed:
            self._batches += 1
            self.recorder.keep_batch(self._done + 1, batch, loss_fn)

    def scale_used_at(self, step: int) -> float:
        """The loss scale window ``step`` ran with (1.0 without one). Cost: one host sync."""
        if self.source.loss_scaler is None:
            return 1.0
        if self.recorder is None:
            return float(self.source.loss_scaler.scale_tensor.reshape(-1)[0])
        return self.recorder.scale_used_at(step)
