"""The Guard's flight-recorder and loss-spike arguments, checked: ``flight_recorder=``,
``snapshot_every=``, ``snapshot=``, ``on_spike=`` (what :mod:`ampguard.guard._spikes` runs)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_SNAPSHOT_EVERY",
    "ON_SPIKE",
    "SAMPLE_EVERY",
    "SpikeConfig",
    "check",
    "has_state",
]

ON_SPIKE = (None, "warn", "skip", "rewind", "raise")
DEFAULT_CAPACITY = 256
DEFAULT_SNAPSHOT_EVERY = 100
MAX_CAPACITY = 1 << 16
MAX_SNAPSHOT_EVERY = 10_000_000
SAMPLE_EVERY = 16  # windows between samples of the update ratios and the output amax


@dataclass(frozen=True)
class SpikeConfig:
    """The checked ``flight_recorder`` / ``snapshot_every`` / ``snapshot`` / ``on_spike``."""

    capacity: int  # 0: no ring buffer
    snapshot_every: int
    snapshot: bool | Path  # False, True (host memory) or a folder
    on_spike: str | None

    @property
    def acts(self) -> bool:
        """A spike skips its window."""
        return self.on_spike in ("skip", "rewind", "raise")


def check(
    flight_recorder: Any,
    snapshot_every: Any,
    snapshot: Any,
    on_spike: Any,
    optimizers: list[Any],
    schedulers: list[Any],
) -> SpikeConfig | None:
    """The checked arguments; None when nothing is recorded or detected. ``TypeError`` /
    ``ValueError`` naming the argument and what it allows; nothing is changed."""
    if on_spike not in ON_SPIKE:
        raise ValueError(
            "on_spike must be None, 'warn', 'skip', 'rewind' or 'raise', got " + repr(on_spike)
        )
    if flight_recorder is None or flight_recorder is False:
        capacity = 0
    elif flight_recorder is True:
        capacity = DEFAULT_CAPACITY
    elif isinstance(flight_recorder, int) and not isinstance(flight_recorder, bool):
        if not 8 <= flight_recorder <= MAX_CAPACITY:
            raise ValueError(
                f"flight_recorder must be a number of windows in [8, {MAX_CAPACITY}] (or True, "
                f"False), got {flight_recorder}"
            )
        capacity = flight_recorder
    else:
        raise TypeError(
            "flight_recorder must be an int (windows kept), True or False, got "
            f"{type(flight_recorder).__name__}"
        )
    if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int):
        raise TypeError(f"snapshot_every must be an int, got {type(snapshot_every).__name__}")
    if not 1 <= snapshot_every <= MAX_SNAPSHOT_EVERY:
        raise ValueError(
            f"snapshot_every must be in [1, {MAX_SNAPSHOT_EVERY}] windows, got {snapshot_every}"
        )
    if isinstance(snapshot, (str, os.PathLike)):
        snap: bool | Path = Path(snapshot)
    elif isinstance(snapshot, bool):
        snap = snapshot
    else:
        raise TypeError(
            "snapshot must be True (host memory), False or a folder path, got "
            f"{type(snapshot).__name__}"
        )
    if on_spike == "rewind" and snap is False:
        raise ValueError("on_spike='rewind' needs snapshots: snapshot=False cannot rewind")
    if on_spike is None and capacity == 0:
        return None
    if capacity == 0:
        snap = False if on_spike != "rewind" else snap
    if snap is not False:
        for obj in optimizers:
            if not has_state(obj):
                raise TypeError(
                    f"optimizer: a {type(obj).__name__} has no state_dict()/load_state_dict(), "
                    "so the flight recorder cannot snapshot it; pass snapshot=False"
                )
    return SpikeConfig(capacity, snapshot_every, snap, on_spike)


def has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )
