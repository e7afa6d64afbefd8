"""Resolve a producer's ``telemetry=`` argument (None, a run folder path, or a Telemetry).

A Guard checks the argument with :func:`check_argument` before it changes anything, and
attaches with :func:`attach` once it is built; :func:`ampguard.watch` does the same.
"""

from __future__ import annotations

import os
from typing import Any

from ampguard.telemetry._telemetry import Telemetry
from ampguard.telemetry.source import TelemetrySource

__all__ = ["attach", "check_argument"]


def check_argument(telemetry: Any) -> None:
    """``TypeError`` unless ``telemetry`` is None, a run folder path or a Telemetry (a Guard
    checks it before it changes anything)."""
    if telemetry is not None and not isinstance(telemetry, (str, os.PathLike, Telemetry)):
        raise TypeError(
            "telemetry must be None, a run folder path or an ampguard.Telemetry, got "
            f"{type(telemetry).__name__}"
        )


def attach(telemetry: Any, source: TelemetrySource) -> Telemetry | None:
    """Resolve a Guard's ``telemetry=`` argument (None, a run folder, or a Telemetry) and attach
    it to ``source`` (the Guard, or a watched loop)."""
    if telemetry is None:
        return None
    if isinstance(telemetry, (str, os.PathLike)):
        telemetry = Telemetry(telemetry)
    elif not isinstance(telemetry, Telemetry):
        raise TypeError(
            "telemetry must be None, a run folder path or an ampguard.Telemetry, got "
            f"{type(telemetry).__name__}"
        )
    telemetry._attach(source)
    return telemetry
