"""What the framework callbacks (HF Trainer, Lightning) share: options, the watch, its findings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampguard._util.checks import check_bool
from ampguard.findings import Finding
from ampguard.guard import DEFAULT_CAPACITY
from ampguard.integrations._finish import close_and_report
from ampguard.integrations._policy import AttachPolicy
from ampguard.integrations._recorder import RecorderOptions
from ampguard.integrations.watch import Watch

__all__ = ["WatchingCallback"]


class WatchingCallback:
    """Base of a framework's ``AmpGuardCallback``: holds the options and the :class:`Watch` of
    the current run, and the findings of the last one once it is closed.

    The framework class attaches ``self.watch`` when training starts and calls ``_close()`` when
    it ends; ``_detach()`` is where it removes hooks of its own before the watch closes.
    Options as in :func:`ampguard.watch`: the guard features (fp16 only), ``flight_recorder``,
    ``on_spike``, ``snapshot_every`` and ``signatures`` (the framework hands the batch to
    ``ampguard.triage`` itself).
    """

    def __init__(
        self,
        telemetry: Any = None,
        *,
        report: bool = True,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        on_collapse: str = "warn",
        flight_recorder: int | bool = DEFAULT_CAPACITY,
        on_spike: str | None = "warn",
        snapshot_every: int | None = None,
        signatures: bool | int = False,
    ) -> None:
        check_bool("report", report)
        #: the flight recorder, spike policy and triage options, as in :func:`ampguard.watch`
        options = RecorderOptions(flight_recorder, on_spike, snapshot_every, signatures)
        options.validate()
        self.recorder_options = options
        self.telemetry = telemetry
        self.report = report
        self.policy = AttachPolicy(
            min_scale, max_scale, hysteresis, consecutive_hysteresis, on_collapse
        )
        self.watch: Watch | None = None
        self._findings: list[Finding] = []
        #: a checkpoint's ``Watch.state_dict()``, loaded into the next watch attached (resume)
        self.resume_state: dict[str, Any] | None = None

    @property
    def keeps_batches(self) -> bool:
        """The framework's batches are kept: for ``ampguard.triage`` (``signatures``) or
        ``ampguard.autopsy`` (``snapshot_every``)."""
        options = self.recorder_options
        return bool(options.signatures) or options.snapshot_every is not None

    def _resume(self) -> None:
        """Load the checkpoint's state (if one was given) into the watch just attached."""
        state, self.resume_state = self.resume_state, None
        if state is not None and self.watch is not None:
            self.watch.load_state_dict(state)

    @property
    def run_dir(self) -> Path | None:
        """The run folder of the current or last run (None before the first)."""
        return self.watch.run_dir if self.watch is not None else None

    def findings(self) -> list[Finding]:
        """Findings of the last run (while it runs: so far).

        Cost: while the run is open, one flush of the run log (a host sync).
        """
        if self.watch is not None and not self.watch.closed:
            return self.watch.findings()
        return list(self._findings)

    def _detach(self) -> None:
        """Remove the framework class's own hooks (none here)."""

    def _close(self) -> None:
        self._detach()
        if self.watch is not None and not self.watch.closed:
            self._findings = close_and_report(self.watch, self.report)
