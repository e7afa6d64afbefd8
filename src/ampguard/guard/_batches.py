"""Where the autopsy gets a window's batches: the ones recorded by ``guard.step(batch=...,
loss_fn=...)``, else a batch provider, ``ag.autopsy(guard, batches=fn, loss_fn=fn)``.

A provider is called as ``batches(step)`` for a window the Guard did not record and returns that
window's batch (with ``accumulation_steps > 1``: a sequence of its micro-batches, in order). It
must return what the run trained on; the autopsy's replay checks every replayed loss against the
recorded one, so a provider that does not is reported, not trusted. Cost: the provider's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Batches", "check"]


def check(batches: Any, loss_fn: Any) -> None:
    """``TypeError``/``ValueError`` naming the argument for a bad provider; nothing is touched."""
    if batches is None:
        if loss_fn is not None:
            raise ValueError("loss_fn= goes with batches=: pass both, or neither")
        return
    if not callable(batches):
        raise TypeError(
            f"batches must be a callable step -> batch (or None), got {type(batches).__name__}"
        )
    if not callable(loss_fn):
        raise ValueError(
            "batches= needs loss_fn=, a callable loss_fn(model, batch) -> loss (the one the "
            f"run used), got {type(loss_fn).__name__}"
        )


class Batches:
    """Window -> its micro-batches' ``(batch, loss_fn)``: recorded first, then the provider."""

    def __init__(
        self,
        recorded: Mapping[int, list[tuple[Any, Any]]],
        provider: Callable[[int], Any] | None,
        loss_fn: Any,
        accumulation: int,
    ) -> None:
        self.recorded, self.provider = recorded, provider
        self.loss_fn, self.accumulation = loss_fn, accumulation

    def __contains__(self, step: object) -> bool:
        return step in self.recorded or self.provider is not None

    def __getitem__(self, step: int) -> list[tuple[Any, Any]]:
        if step in self.recorded:
            return list(self.recorded[step])
        assert self.provider is not None
        got = self.provider(step)
        if self.accumulation == 1:
            return [(got, self.loss_fn)]
        micro = list(got) if isinstance(got, (list, tuple)) else None
        if micro is None or len(micro) != self.accumulation:
            raise ValueError(
                f"batches({step}) must return the window's {self.accumulation} micro-batches "
                f"(accumulation_steps={self.accumulation}) as a list, got "
                + (f"{len(micro)}" if micro is not None else type(got).__name__)
            )
        return [(b, self.loss_fn) for b in micro]
