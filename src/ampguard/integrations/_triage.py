"""``ampguard.triage`` on an attached run: what each framework lets it replay.

``ag.triage(handle)`` reads a :class:`~ampguard.integrations.watch.Watch` as it reads a Guard
(``signatures``, ``flight_recorder``, ``model``, ``steps``, ``precision``, ``scale_used_at``,
``telemetry``). A replay needs the failed step's signatures (``signatures=True``) and its batch
with a ``loss_fn(model, batch)``:

* the **HF Trainer** callback takes the batch from the model's forward (the keyword arguments
  ``Trainer.training_step`` calls it with) and replays ``model(**batch).loss``;
* the **Lightning** callback takes the batch from ``on_train_batch_start`` and replays
  ``training_step(batch, 0)``;
* **plain loops and Accelerate** own their forward: the loop hands each batch to
  ``handle.record_batch(batch, loss_fn)``;
* **DeepSpeed** owns the forward of a converted (fp16/bf16) and partitioned module, so no step
  can be replayed outside the engine: triage is not available there.

Where something is missing, reading ``handle.signatures`` (the first thing ``triage`` reads)
raises one ``ValueError`` saying what and how to get it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["NO_REPLAY", "hf_loss", "lightning_loss", "signatures_of"]

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
    return recorder


def hf_loss(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The HF Trainer's default loss: ``model(**batch).loss``."""
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError("the model's output has no loss (give the batch labels)")
    return loss


def lightning_loss(module: Any, batch: Any) -> torch.Tensor:
    """A LightningModule's ``training_step(batch, 0)`` loss (a tensor, or a dict's ``loss``)."""
    out = module.training_step(batch, 0)
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError("training_step returned no loss tensor")
    return loss
