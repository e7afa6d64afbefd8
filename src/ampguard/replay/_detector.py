"""Loss-spike detection on the device: a robust running statistic of the log-loss, no host sync.

Per window, with ``x = log(loss)`` (a 0-dim fp32 tensor), its running mean ``m`` (horizon
``1 / (1 - beta_mean)`` windows) and the running noise ``s`` (horizon ``1 / (1 - beta)``)::

    bound = m + max(threshold * s, log(min_ratio))
    spike = armed and x > bound                                # armed: warmup windows seen
    kept  = x < bound (finite, not a spike)                    # a spike never moves the statistic
    m     = m + a (x - m)                        where kept    # a = max(1 / count, 1 - beta_mean)
    s     = s + b (0.886 |x - x_prev| - s)       where kept    # b = max(1 / count, 1 - beta)

The noise is the mean absolute difference of consecutive kept log-losses (0.886 of it is the
standard deviation of Gaussian noise): the fast fall of early training (a trend, not noise)
does not inflate it, and a heavy-tailed loss weighs in linearly, not squared. The
log makes the rule scale-free (a loss of 0.01 and one of 10 are judged alike); the test is
one-sided (a falling loss never triggers) and the first ``warmup`` windows only learn, so the
fast-falling loss of early training never triggers. A spike does not enter the statistic, so a
short run of spikes keeps being seen as such; but a loss that stays above the bound for
``SPIKE_RUN`` windows in a row is a new level, not a spike (a skip cannot undo the update that
raised it, so skipping on would lose every later update): that window resets the mean to it
(the noise is kept) and later windows are judged against the new level::

    run = (run + 1) * spike                                    # flagged windows in a row
    at run == SPIKE_RUN:  m = x, x_prev = x, run = 0           # the window is still flagged

Non-finite losses are left to the non-finite skip.
Cost: 17 small device ops per window once armed, no host sync (``count`` is a host int).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["SPIKE_RUN", "LossSpikeError", "SpikeDetector"]

SPIKE_RUN = 5  # flagged windows in a row after which the loss is taken as its new level


class SpikeDetector:
    """The running statistic and rule of the module docstring, on ``device``.

    ``threshold``: spread multiples above the mean that make a spike (6: the z-score OLMo-core
    and levanter skip at); ``min_ratio``: the smallest loss ratio over ``exp(m)`` that counts,
    whatever the spread (a very smooth loss); ``warmup``: windows that only learn;
    ``beta``: the statistic's decay per window.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        threshold: float = 6.0,
        min_ratio: float = 1.3,
        warmup: int = 50,
        beta: float = 0.98,
        beta_mean: float = 0.9,
    ) -> None:
        self.device = device
        self.threshold = float(threshold)
        self.log_min_ratio = math.log(float(min_ratio))
        self.warmup = int(warmup)
        self.beta = float(beta)
        self.beta_mean = float(beta_mean)
        f32: dict[str, Any] = {"dtype": torch.float32, "device": device}
        # the statistic as one vector [m, s, x_prev]: a window's update is a few vector ops
        self.state = torch.zeros(3, **f32)
        self.run = torch.zeros((), **f32)  # windows flagged in a row (a level shift at SPIKE_RUN)
        self._one = torch.ones(3, **f32)
        self._coef = torch.ones(3, **f32)  # [a, b, 1] (host-known; refilled while warming up)
        self._coef_at: tuple[float, float] | None = None
        self._inf = torch.full((), math.inf, **f32)
        self._zero = torch.zeros((), **f32)
        self.count = 0  # windows fed so far (host: known without a sync)
        self._bound: torch.Tensor | None = None  # the next window's log bound, once armed

    @property
    def mean(self) -> torch.Tensor:
        """The running mean of the log-loss (a view; 0-dim)."""
        return self.state[0]

    @property
    def spread(self) -> torch.Tensor:
        """The running noise of the log-loss (a view; 0-dim)."""
        return self.state[1]

    @property
    def armed(self) -> bool:
        """The warm-up is over: a spike can be reported. Cost: none (host int)."""
        return self.count >= self.warmup

    def observe(self, loss: torch.Tensor, record: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one window's loss; returns the spike flag (a new 0-dim fp32 0/1 tensor).
        ``record``: a 4-float device view that receives ``[loss, log bound, mean, spike]``
        (see :meth:`measure`). Cost: about 15 device ops, no host sync."""
        flag, pieces = self.measure(loss)
        if record is not None:
            torch.stack(pieces, out=record)
        return flag

    def measure(self, loss: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Feed one window's loss; returns the spike flag (a new 0-dim fp32 0/1 tensor) and the
        window's record ``[loss, log bound, mean, spike]`` as 0-dim tensors (the log-loss above
        which the window spikes, inf while warming up, and the running mean of the log-loss it
        was judged against), for the caller to write with its own row. Cost: 17 small device
        ops once armed (the next window's bound is computed here too), no host sync."""
        loss = loss.detach().reshape(())
        if loss.dtype != torch.float32:
            loss = loss.float()
        x = loss.clamp_min(1e-30).log_()
        if self.count == 0:  # the first window: the statistic starts at it
            self.state = torch.stack([x, self._zero, x]).nan_to_num_(0.0, 0.0, 0.0)
            self.count = 1
            self._bound = None
            return self._zero.clone(), [loss, self._inf, x, self._zero]
        state = self.state
        if self.armed:
            bound = self._bound if self._bound is not None else self._bound_of(state)
            spike = torch.gt(x, bound).float()  # NaN never spikes (the non-finite skip has it)
        else:
            bound, spike = self._inf, torch.zeros_like(x)
        keep = torch.lt(x, bound)  # finite and not a spike: a spike never moves the statistic
        self.count += 1
        self._set_coef()
        noise = torch.dist(x, state[2]).mul_(0.886)  # |x - x_prev|
        run = self.run.add(1).mul_(spike)
        shift = run.ge(SPIKE_RUN)  # a lasting level: the mean jumps to it, the noise stays
        target = torch.where(keep, torch.stack([x, noise, x]), state)
        target = torch.where(shift, torch.stack([x, state[1], x]), target)
        # out of place: the record keeps the mean the window was judged against
        self.state = torch.lerp(state, target, torch.where(shift, self._one, self._coef))
        self.run = run.masked_fill_(shift, 0.0)
        self._bound = self._bound_of(self.state) if self.armed else None
        return spike, [loss, bound, state[0], spike]

    def _bound_of(self, state: torch.Tensor) -> torch.Tensor:
        """The log-loss above which the next window spikes: ``m + max(threshold * s,
        log(min_ratio))``. Cost: 2 device ops (3 with a threshold <= 0)."""
        if self.threshold > 0:  # m + threshold * max(s, log(min_ratio) / threshold)
            floor = self.log_min_ratio / self.threshold
            return torch.add(state[0], state[1].clamp_min(floor), alpha=self.threshold)
        return state[1].mul(self.threshold).clamp_min_(self.log_min_ratio).add_(state[0])

    def _set_coef(self) -> None:
        a = max(1.0 / self.count, 1.0 - self.beta_mean)
        b = max(1.0 / self.count, 1.0 - self.beta)
        if self._coef_at != (a, b):  # constant once both horizons are reached
            self._coef[0].fill_(a)
            self._coef[1].fill_(b)
            self._coef_at = (a, b)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The statistic, for a resume (``Guard.state_dict()["spikes"]``). Cost: one host sync."""
        mean, spread, prev = self.state.tolist()
        run = int(self.run.item())
        return {"mean": mean, "spread": spread, "prev": prev, "count": self.count, "run": run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back :meth:`state_dict` output (checked by :func:`check_state`)."""
        prev = state.get("prev", state["mean"])
        self.state.copy_(torch.tensor([state["mean"], state["spread"], prev]))
        self.count = int(state["count"])
        self.run.fill_(float(state.get("run", 0)))
        self._coef_at = None
        self._bound = None

    @staticmethod
    def check_state(state: Any) -> dict[str, Any]:
        """``state`` as :meth:`load_state_dict` takes it; ``ValueError`` naming the bad field."""
        if not isinstance(state, dict):
            raise ValueError(f"malformed Guard state: 'spikes' must be a dict, got {state!r}")
        for key in ("mean", "spread"):
            v = state.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(
                    f"malformed Guard state: 'spikes.{key}' must be a finite number, got {v!r}"
                )
        c = state.get("count")
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(
                f"malformed Guard state: 'spikes.count' must be an int >= 0, got {c!r}"
            )
        r = state.get("run", 0)
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < SPIKE_RUN:
            raise ValueError(
                f"malformed Guard state: 'spikes.run' must be an int in [0, {SPIKE_RUN}), got {r!r}"
            )
        if state["spread"] < 0:
            raise ValueError("malformed Guard state: 'spikes.spread' must be >= 0")
        return state


class LossSpikeError(RuntimeError):
    """``Guard(on_spike="raise")``: a window's loss spiked. ``step``, ``loss`` and ``bound``
    (the loss above which the window counts as a spike) say which and by how much; the window
    was skipped, so the weights are those of the window before it."""

    def __init__(self, message: str, *, step: int, loss: float, bound: float) -> None:
        super().__init__(message)
        self.step, self.loss, self.bound = step, loss, bound


LossSpikeError.__module__ = "ampguard.replay"  # its public home: repr and pickles name that path
