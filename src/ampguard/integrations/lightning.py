"""Lightning: ``AmpGuardCallback`` reads the precision plugin's scaler and the gradients.

>>> trainer = L.Trainer(precision="16-mixed", callbacks=[AmpGuardCallback()])
>>> trainer.fit(model, data)          # run log + report.html in <default_root_dir>/ampguard

The callback attaches to ``trainer.precision_plugin.scaler`` (:func:`ampguard.watch`) when the
fit starts; no number changes. Lightning's AMP plugin calls ``scaler.unscale_`` and then
``on_before_optimizer_step``. ampguard samples the gradients just before that unscale (without
a scaler: in ``on_before_optimizer_step``), takes the loss from ``scaler.scale`` (without a
scaler: from ``on_before_backward``), and the skip from the scaler's ``found_inf`` at
``scaler.update``.

To run ampguard's scaler settings (floor, cap, hysteresis) under Lightning, build the plugin's
scaler from a :class:`ampguard.ScalerConfig` and hand the same config to the callback::

    cfg = ag.ScalerConfig(init_scale=2.0**12, growth_interval=500, min_scale=1.0, hysteresis=2)
    plugin = MixedPrecision("16-mixed", "cuda", scaler=grad_scaler(cfg, "cuda"))
    trainer = L.Trainer(plugins=[plugin], callbacks=[AmpGuardCallback(**guard_options(cfg))])
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ampguard import precisions
from ampguard.integrations._callbacks import WatchingCallback
from ampguard.integrations._extras import require
from ampguard.integrations._findings import fp16_inactive
from ampguard.integrations._resume import check_state
from ampguard.integrations._triage import lightning_loss
from ampguard.integrations.watch import Watch

require("lightning", "ampguard.integrations.lightning")

from lightning.pytorch.callbacks import Callback  # noqa: E402

__all__ = ["AmpGuardCallback", "lightning_precision"]

# Lightning's precision values -> ampguard's precisions (checked against the registry)
_PRECISIONS = precisions.checked(
    {
        "16-mixed": "fp16",
        "16-true": "fp16",
        "bf16-mixed": "bf16",
        "bf16-true": "bf16",
        "32-true": "fp32",
        "64-true": "fp32",
    },
    source="Lightning's precision map",
)
_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}


class AmpGuardCallback(WatchingCallback, Callback):
    """Attach ampguard to a ``lightning.pytorch.Trainer`` fit.

    ``telemetry``: a run folder or an :class:`ampguard.Telemetry`; default
    ``<trainer.default_root_dir>/ampguard``. ``report``: write ``report.html`` when the fit ends
    (needs matplotlib). ``precision``: the ``precision`` given to the Trainer; Lightning replaces
    ``"16-mixed"`` by ``"bf16-mixed"`` on CPU without keeping the request, so only with it can
    ampguard report that switch (AG122). Guard options as in :func:`ampguard.watch` (16-mixed
    only). ``flight_recorder``, ``on_spike``, ``snapshot_every``, ``signatures`` as in
    :func:`ampguard.watch`: a spike is skipped through the plugin's GradScaler (16-mixed) or the
    optimizer's step (bf16/32; the closure is run first); Lightning still steps its LR
    schedulers. ``ampguard.triage(callback.watch)`` replays ``training_step(batch, 0)``.
    After the fit, ``findings()`` returns the run's findings and ``run_dir`` its folder.
    """

    def __init__(
        self, telemetry: Any = None, *, precision: str | int | None = None, **options: Any
    ) -> None:
        super().__init__(telemetry, **options)
        if (
            precision is not None
            and str(precision) not in _PRECISIONS
            and str(precision) not in _ALIASES
        ):
            raise ValueError(
                f"precision must be one of Lightning's precision values "
                f"{sorted(_PRECISIONS)}, got {precision!r}"
            )
        self.requested_precision = (
            None if precision is None else _ALIASES.get(str(precision), str(precision))
        )

    # ------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._attach(trainer, pl_module)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        # Under 16-mixed this loss is already scaled; the watch then takes the unscaled one
        # from scaler.scale and ignores this call.
        if self.watch is not None:
            self.watch.record_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.watch is None or self.watch.closed:
            self._attach(trainer, pl_module)  # e.g. a callback added after on_fit_start
        assert self.watch is not None
        # Without a scaler the gradients are final here; Lightning runs the closure (forward and
        # backward) inside optimizer.step, after the optimizer's own pre-step hooks.
        assert self.watch is not None  # _attach always sets one
        self.watch.observe_grads()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.watch is not None and self.keeps_batches:  # for ampguard.triage / autopsy
            self.watch.record_batch(batch, lightning_loss)

    def state_dict(self) -> dict[str, Any]:
        """Lightning keeps this in each checkpoint: the watch's ``state_dict()`` (the steps and
        the spike detector's statistic). Cost: one host sync."""
        return {} if self.watch is None else {"watch": self.watch.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume (``trainer.fit(ckpt_path=...)``): the watch attached next starts from the
        checkpoint's step count and spike statistic (checked: ``ValueError`` naming the field)."""
        saved = state_dict.get("watch")
        if saved is not None:
            self.resume_state = check_state(saved)
            if self.watch is not None and not self.watch.closed and self.watch.steps == 0:
                self._resume()  # restored after on_fit_start (restore_checkpoint_after_setup)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.watch is not None and self.watch.recorder is not None:
            self.watch.recorder.on_error(exception)  # the flight recorder dumps its ring
        self._close()  # keep what was recorded up to the failure

    # ------------------------------------------------------------------ helpers
    def _attach(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        telemetry = (
            self.telemetry
            if self.telemetry is not None
            else os.path.join(trainer.default_root_dir, "ampguard")
        )
        self.watch = Watch(
            scaler,
            pl_module,
            list(trainer.optimizers),
            telemetry,
            precision=lightning_precision(plugin, scaler),
            policy=self.policy,
            framework="lightning",
            grads_from_optimizer_hooks=False,
            recorder=self.recorder_options,
            clip_grad_norm=_clip_norm(trainer),
            requested_precision=(
                None
                if self.requested_precision is None
                else _PRECISIONS.get(self.requested_precision, precisions.full())
            ),
        )
        self.watch.accumulation = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        self._resume()  # a checkpoint's steps and spike statistic (load_state_dict)
        actual = str(getattr(plugin, "precision", "32-true"))
        if self.requested_precision == "16-mixed" and self.watch.scaler is None:
            self.watch.add_finding(
                fp16_inactive(
                    "lightning",
                    f"precision='16-mixed' became {actual!r} on "
                    f"{type(trainer.accelerator).__name__}",
                    actual=_PRECISIONS.get(actual, precisions.full()),
                )
            )


def _clip_norm(trainer: Any) -> float | None:
    """The total-norm clip Lightning applies (``gradient_clip_val`` with the ``"norm"``
    algorithm, its default), for the autopsy's replay; None otherwise."""
    value = getattr(trainer, "gradient_clip_val", None)
    algorithm = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower()
    return float(value) if value and algorithm.endswith("norm") else None


def lightning_precision(plugin: Any, scaler: Any) -> str:
    """ampguard's precision name for a Lightning precision plugin."""
    if scaler is not None and scaler.is_enabled():
        return precisions.scaled()
    return _PRECISIONS.get(str(getattr(plugin, "precision", "32-true")), precisions.full())
