"""Loss-spike detection on the device: a robust running statistic of the log-loss, no host sync.

Per window, with ``x = log(loss)`` (a 0-dim fp32 tensor), its running mean ``m`` (horizon
``1 / (1 - beta_mean)`` windows) and the running noise ``s`` (horizon ``1 / (1 - beta)``)::

    bound = m + max(threshold * s, log(min_ratio))
    spike = armed and isfinite(x) and x > bound                # armed: warmup windows seen
    kept  = finite and not a spike                             # a spike never moves the statistic
    m     = m + a (x - m)                        where kept    # a = max(1 / count, 1 - beta_mean)
    s     = s + b (0.886 |x - x_prev| - s)       where kept    # b = max(1 / count, 1 - beta)

The noise is the mean absolute difference of consecutive kept log-losses (0.886 of it is the
standard deviation of Gaussian noise): the fast fall of early training (a trend, not noise)
does not inflate it, and a heavy-tailed loss weighs in linearly, not squared. The
log makes the rule scale-free (a loss of 0.01 and one of 10 are judged alike); the test is
one-sided (a falling loss never triggers) and the first ``warmup`` windows only learn, so the
fast-falling loss of early training never triggers. A spike does not enter the statistic, so a
run of spikes keeps being seen as such. Non-finite losses are left to the non-finite skip.
Cost: about a dozen 0-dim device ops per window, no host sync (``count`` is a host int).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["LossSpikeError", "SpikeDetector"]


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
        self.mean = torch.zeros((), dtype=torch.float32, device=device)
        self.spread = torch.zeros((), dtype=torch.float32, device=device)
        self.prev = torch.zeros((), dtype=torch.float32, device=device)  # the last kept x
        self.count = 0  # windows with a finite loss fed so far (host: known without a sync)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def armed(self) -> bool:
        """The warm-up is over: a spike can be reported. Cost: none (host int)."""
        return self.count >= self.warmup

    def observe(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed one window's loss; returns ``(spike, bound, level)``: a 0-dim fp32 0/1 flag,
        the loss above which the window would have spiked (``exp(bound)``; inf while warming
        up) and the running level ``exp(m)`` it was judged against. Cost: device ops only, no
        host sync."""
        x = loss.detach().float().reshape(()).clamp_min(1e-30).log()
        finite = torch.isfinite(x)
        if self.count == 0:  # the first window: the statistic starts at it
            self.mean.copy_(torch.where(finite, x, self._zero))
            self.prev.copy_(self.mean)
            self.count = 1
            inf = torch.full_like(self._zero, math.inf)
            return self._zero.clone(), inf, self.mean.exp()
        level = self.mean.exp()
        spread = self.spread.mul(self.threshold).clamp_min(self.log_min_ratio)
        bound = self.mean + spread
        if self.armed:
            spike = torch.logical_and(finite, x > bound)
            flag = spike.float()
            keep = torch.logical_and(finite, spike.logical_not())
        else:
            flag = self._zero.clone()
            keep = finite
            bound = torch.full_like(bound, math.inf)
        self.count += 1
        a = max(1.0 / self.count, 1.0 - self.beta_mean)
        b = max(1.0 / self.count, 1.0 - self.beta)
        delta = torch.where(keep, x - self.mean, self._zero)
        step = torch.where(keep, x - self.prev, self._zero)
        noise = torch.where(keep, step.abs().mul(0.886).sub(self.spread), self._zero)
        self.spread.add_(noise, alpha=b)
        self.mean.add_(delta, alpha=a)
        self.prev.add_(step)
        return flag, bound.exp(), level

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The statistic, for a resume (``Guard.state_dict()["spikes"]``). Cost: one host sync."""
        return {
            "mean": float(self.mean),
            "spread": float(self.spread),
            "prev": float(self.prev),
            "count": self.count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back :meth:`state_dict` output (checked by :func:`check_state`)."""
        self.mean.fill_(float(state["mean"]))
        self.spread.fill_(float(state["spread"]))
        self.prev.fill_(float(state.get("prev", state["mean"])))
        self.count = int(state["count"])

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
