"""What ``ampguard.autopsy`` reads of a run that is not a Guard: :class:`AutopsySubject`.

The autopsy (:mod:`ampguard.guard._autopsy`) reads a Guard through a few public attributes
(``model``, ``optimizers``, ``flight_recorder``, ``precision``, ``policy``,
``accumulation_steps``, ``clip_grad_norm``, ``device``, ``distributed``, ``rescue``,
``settle_pending()``). Attach mode (``ampguard.watch`` and the framework callbacks) hands it an
:class:`AutopsySubject` with the same attributes, filled from what the framework did (its
precision, its loss scale through the recorder's snapshots, its clipping and accumulation where
it says so), plus what a Guard does not need: ``no_replay`` (why no replay can run at all, e.g.
DeepSpeed's engine owns the forward) and ``record_hint`` (how this run records its batches, for
the evidence line of a window without one) and ``differs_hint`` (what the replay may not know of
the run, added where a replayed loss differs from the recorded one). An object with
``autopsy_subject()`` (an attach handle) is read through it; the replay then runs as for a
Guard, or is refused with ``verified=False`` and the reason in ``evidence["replay"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.core.policy import PrecisionPolicy

__all__ = ["GUARD_RECORD_HINT", "AutopsySubject", "subject_of"]

GUARD_RECORD_HINT = (
    "pass guard.step(batch=..., loss_fn=...) on every micro-batch, or autopsy(guard, "
    "batches=..., loss_fn=...)"
)


@dataclass
class AutopsySubject:
    """A run ``ampguard.autopsy`` can read as it reads a Guard (see the module docstring).

    ``flight_recorder``: the run's :class:`~ampguard.guard.SpikeWatch` (ring, events,
    snapshots, batches). ``no_replay``: None, or why this run cannot be replayed (every
    diagnosis is then the signal read, ``verified=False``). ``settle``: reads the run's pending
    spike flags (a host sync)."""

    model: torch.nn.Module
    optimizers: list[Any]
    flight_recorder: Any
    precision: str
    device: torch.device
    accumulation_steps: int = 1
    clip_grad_norm: float | None = None
    distributed: Any = None
    rescue: Any = None
    no_replay: str | None = None
    record_hint: str = GUARD_RECORD_HINT
    differs_hint: str = ""  # added to the evidence of a replay that differs from the record
    settle: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def policy(self) -> PrecisionPolicy:
        """The run's precision as the Guard's policy (what an intervention reads of it)."""
        return PrecisionPolicy(self.precision, self.device.type)

    def settle_pending(self) -> None:
        """The run's pending spike flags read and acted on. Cost: one host sync."""
        if self.settle is not None:
            self.settle()


def subject_of(run: Any) -> Any:
    """``run`` itself (a Guard), or ``run.autopsy_subject()`` (an attach handle; it raises the
    ``ValueError`` of a run that recorded nothing)."""
    make = getattr(run, "autopsy_subject", None)
    return make() if callable(make) else run
