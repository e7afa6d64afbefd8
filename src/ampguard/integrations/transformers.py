"""Hugging Face ``Trainer``: ``AmpGuardCallback`` records each optimizer step and writes a report.

>>> trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True), train_dataset=data,
...                   callbacks=[AmpGuardCallback()])        # run log in <output_dir>/ampguard
>>> trainer.train()                                          # report.html written at the end

The callback finds the Trainer's ``GradScaler`` on its ``AcceleratedOptimizer`` and attaches to it
(:func:`ampguard.watch`): no number changes. Under bf16/fp32 (no scaler) it records every
optimizer step and takes the loss from the model output. Skips are read from ``found_inf``, and
steps the Trainer wrongly counted as applied (fused optimizer: the LR scheduler advanced on a
skipped step) are reported as AG120.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ampguard import precisions, runlog
from ampguard.findings import Finding
from ampguard.integrations._callbacks import WatchingCallback
from ampguard.integrations._extras import require
from ampguard.integrations._findings import fp16_inactive
from ampguard.integrations._triage import HFLoss, hf_loss
from ampguard.integrations.watch import Watch

require("transformers", "ampguard.integrations.transformers")
from transformers import TrainerCallback  # noqa: E402

from ampguard.integrations.accelerate import observe_skip_flags  # noqa: E402

__all__ = ["AmpGuardCallback", "STATE_FILE"]

STATE_FILE = "ampguard_state.json"  # the watch's state_dict() in each checkpoint folder


class AmpGuardCallback(WatchingCallback, TrainerCallback):
    """Attach ampguard to a ``transformers.Trainer`` run.

    ``telemetry``: a run folder or an :class:`ampguard.Telemetry`; default
    ``<output_dir>/ampguard``. ``report``: write ``report.html`` when training ends (needs
    matplotlib). Guard options (``min_scale``, ``max_scale``, ``hysteresis``,
    ``consecutive_hysteresis``, ``on_collapse``) as in :func:`ampguard.watch`, fp16 only.
    ``flight_recorder``, ``on_spike``, ``snapshot_every``, ``signatures`` as in
    :func:`ampguard.watch`: a spike is skipped through the GradScaler (fp16; the LR scheduler
    does not advance) or the optimizer's step (bf16/fp32), and ``ampguard.triage(callback.watch)``
    replays ``model(**batch).loss`` from the batch the Trainer gave the model.
    After training, ``findings()`` returns the run's findings and ``run_dir`` its folder.
    """

    _loss_hook: Any = None  # the forward hook taking the loss when there is no scaler
    _batch_hook: Any = None  # the forward pre-hook keeping the batch for ampguard.triage

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        self._close()
        if model is None or optimizer is None:
            raise ValueError(
                "AmpGuardCallback needs the Trainer's model and optimizer "
                "(transformers passes them to on_train_begin)"
            )
        scaler = getattr(optimizer, "scaler", None)
        precision, note = _trainer_precision(args, scaler)
        telemetry = (
            self.telemetry
            if self.telemetry is not None
            else os.path.join(args.output_dir, "ampguard")
        )
        self.watch = Watch(
            scaler,
            model,
            optimizer,
            telemetry,
            precision=precision,
            policy=self.policy,
            framework="transformers",
            requested_precision=_trainer_request(args),
            recorder=self.recorder_options,
            clip_grad_norm=float(getattr(args, "max_grad_norm", 0.0) or 0.0) or None,
        )
        self.watch.accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        self._resume_from(args, state)
        if note is not None:
            self.watch.add_finding(note)
        observe_skip_flags(self.watch, optimizer)
        if self.watch.scaler is None:
            self._loss_hook = model.register_forward_hook(self._record_output_loss)
        if self.keeps_batches:  # ampguard.triage / autopsy replay model(**batch).loss
            self._batch_hook = model.register_forward_pre_hook(self._keep_batch, with_kwargs=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer wrote ``<output_dir>/checkpoint-<step>``: the watch's ``state_dict()``
        (steps, spike statistic) goes beside it as ``ampguard_state.json`` (written atomically;
        the main process only). Cost: one host sync per checkpoint."""
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self.watch is not None and args.should_save and os.path.isdir(folder):
            runlog.write_json_atomic(Path(folder) / STATE_FILE, self.watch.state_dict())

    def _resume_from(self, args: Any, state: Any) -> None:
        """A resumed ``trainer.train(resume_from_checkpoint=...)`` starts at the checkpoint's
        ``global_step``: load the ``ampguard_state.json`` of ``<output_dir>/checkpoint-<step>``
        (the folder the Trainer names and ``resume_from_checkpoint=True`` finds); else set
        ``callback.resume_state`` before ``train()``."""
        step = int(getattr(state, "global_step", 0) or 0)
        path = Path(args.output_dir) / f"checkpoint-{step}" / STATE_FILE
        if self.resume_state is None and step > 0 and path.is_file():
            self.resume_state = json.loads(path.read_text())
        self._resume()

    # ------------------------------------------------------------------ helpers
    def _record_output_loss(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not module.training or self.watch is None:
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.watch.record_loss(loss)

    def _keep_batch(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        # Trainer.training_step calls model(**inputs): the batch is the keyword arguments; the
        # Trainer's num_items_in_batch (the loss's divisor) goes into the loss function, scaled
        # to the samples replayed, so the autopsy can drop samples from the batch
        if module.training and self.watch is not None and not args:
            batch = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
            items = kwargs.get("num_items_in_batch")
            self.watch.record_batch(batch, hf_loss if items is None else HFLoss(items, batch))

    def _detach(self) -> None:
        for hook in (self._loss_hook, self._batch_hook):
            if hook is not None:
                hook.remove()
        self._loss_hook = self._batch_hook = None


# TrainingArguments' precision flags -> ampguard's precisions (checked against the registry)
_FLAGS = precisions.checked({"fp16": "fp16", "bf16": "bf16"}, source="transformers' flag map")


def _asked(args: Any) -> list[str]:
    return [name for flag, name in _FLAGS.items() if getattr(args, flag, False)]


def _trainer_request(args: Any) -> str:
    """What the TrainingArguments ask for (recorded as ``requested_precision``)."""
    return next(iter(_asked(args)), precisions.full())


def _trainer_precision(args: Any, scaler: Any) -> tuple[str, Finding | None]:
    if scaler is not None and scaler.is_enabled():
        return precisions.scaled(), None
    asked = _asked(args)
    unscaled = [n for n in asked if not precisions.REGISTRY[n].needs_scaler]
    if unscaled:
        return unscaled[0], None
    if asked:  # a scaled precision was asked for, but no scaler runs
        return precisions.full(), fp16_inactive(
            "transformers.Trainer",
            f"fp16=True, but Accelerate creates no GradScaler and no "
            f"fp16 autocast on device {str(getattr(args, 'device', '?'))!r}",
        )
    return precisions.full(), None
