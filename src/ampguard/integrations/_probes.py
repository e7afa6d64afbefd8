"""The Watch's probes around the first optimizer's update: the stagnation probe of bf16/fp16
weights whose updates round away, and EMA / teacher weights the optimizer does not own (AG175,
as the Guard measures them; :mod:`ampguard.core.stagnation`, :mod:`ampguard.core.ema`)."""

from __future__ import annotations

from typing import Any

import torch

from ampguard.core.stagnation import StagnationProbe
from ampguard.integrations._optim import params_of

__all__ = ["UpdateProbes"]


class UpdateProbes:
    """A mixin of the Watch: hooks on the first optimizer's step (no host sync)."""

    optimizers: list[Any]
    emas: list[Any]
    _hooks: list[Any]
    _stagnation: StagnationProbe | None
    _update_window: int
    _ema_window: int
    _closed: bool
    _done: int

    def _watch_stagnation(self, model: torch.nn.Module) -> StagnationProbe | None:
        """Sample the first optimizer's low-precision weights around its step (AG175, as the
        Guard does). Only that optimizer's: the window is its step, and another optimizer's
        weights would not have moved yet. Cost: nothing unless its weights are bf16/fp16; then
        a copy of them before a sampled step and a count after it, no host sync."""
        primary = self.optimizers[0]
        probe = StagnationProbe.of(model, params_of([primary]))
        if probe is not None:
            self._hooks += [
                primary.register_step_pre_hook(self._before_update),
                primary.register_step_post_hook(self._after_update),
            ]
        return probe

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # the window is fixed here: the step may be recorded (and counted) before _after_update
        self._update_window = self._done + 1
        if self._stagnation is not None and not self._closed:
            self._stagnation.before(self._update_window)

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        probe, window = self._stagnation, self._update_window
        if probe is not None and probe.sampling(window):
            # a fused optimizer stepped by a GradScaler skips inside its kernel: GradScaler lends
            # it its found_inf flag for the step (a skipped window adds nothing; no sync)
            found = getattr(optimizer, "found_inf", None)
            probe.after(window, found.bool() if isinstance(found, torch.Tensor) else False)

    def _after_ema(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._ema_window += 1
        found = getattr(optimizer, "found_inf", None)  # a fused step GradScaler skipped
        for w in self.emas:
            w.on_window(
                self._ema_window, found.bool() if isinstance(found, torch.Tensor) else False
            )
