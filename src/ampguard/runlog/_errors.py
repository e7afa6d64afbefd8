"""The error a run folder's writer raises: :class:`TelemetryError` (torch-free)."""

from __future__ import annotations

__all__ = ["TelemetryError"]


class TelemetryError(RuntimeError):
    """The run folder cannot be written: it cannot be created, another writer holds it, or a
    write failed (a full or read-only disk) while ``Telemetry(on_write_error="raise")``.

    The message names the file or folder and the reason; the ``OSError`` behind it, if any, is
    the ``__cause__``. ``path`` is the file or folder concerned.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


TelemetryError.__module__ = "ampguard.runlog"  # its public home: repr and pickles name that path
