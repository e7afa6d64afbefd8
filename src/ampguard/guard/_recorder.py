"""The flight recorder's dumps: every rank writes its ring buffer into the run folder on a trigger.

Triggers: a loss spike, non-finite gradients or loss (once the flags are on the host), an
exception out of ``Guard.step()`` (``PeerFailureError``, ``ScaleCollapseError``,
``LossSpikeError``...) and SIGTERM (a handler installed from the main thread, chained to the one
before it, removed by ``Guard.close()``). Each rank writes
``RUN_DIR/flight_recorder/rank<R>.json`` (temporary file, fsync, rename: never half-written), at
most once per trigger kind per ``capacity // 2`` windows. A dump that cannot be written (a full
or read-only disk) warns once and is dropped: it never blocks training nor loses the step's
update. ``ampguard postmortem RUN_DIR`` merges the ranks' dumps
(:mod:`ampguard.reporting.postmortem`).

The file (``kind: "ampguard.flight_recorder"``, ``version: 1``): ``rank``, ``world_size``,
``trigger``, ``step``, ``names`` (the parameters, in the order of ``grad_norm`` and
``update_ratio``), ``modules`` (the layers, in the order of ``amax``), ``rows`` (one per
recorded window, oldest first: ``step``, ``lr``, ``loss``, ``bound``, ``level``, ``spike``,
``status``, ``scale``, ``grad_norm``, ``update_ratio``, ``amax``; NaN and inf as null) and
``spikes`` (the detected spikes: ``step``, ``loss``, ``bound``, ``level``, ``action``).
Cost of a dump: one host sync (the ring's copy) and the write.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

from ampguard._util.stack import user_stacklevel
from ampguard.runlog import FLIGHT_RECORDER_DIR as DUMP_DIR
from ampguard.runlog import FLIGHT_RECORDER_KIND as DUMP_KIND
from ampguard.runlog import FLIGHT_RECORDER_VERSION as DUMP_VERSION
from ampguard.runlog import write_json_atomic

__all__ = ["Dumper", "run_dir_of"]


def run_dir_of(telemetry: Any, rank: int) -> Path | None:
    """The run folder named by a Guard's ``telemetry=`` argument (a path, ``{rank}`` formatted,
    or a ``Telemetry``), the same on every rank; None without one."""
    if telemetry is None:
        return None
    if isinstance(telemetry, (str, os.PathLike)):
        return Path(os.fspath(telemetry).replace("{rank}", str(rank)))
    run_dir = getattr(telemetry, "run_dir", None)
    return None if run_dir is None else Path(run_dir)


class Dumper:
    """Writes the ring of ``watch`` (an ``ampguard.guard._spikes.SpikeWatch``) to ``run_dir``."""

    def __init__(self, watch: Any, run_dir: Path, rank: int = 0, world_size: int = 1) -> None:
        self.watch = watch
        self.run_dir = Path(run_dir)
        self.rank, self.world_size = rank, world_size
        self.last: dict[str, int] = {}  # trigger -> step of its last dump
        self.failed = False
        self.paths: list[Path] = []
        self._sigterm: tuple[Any, Any] | None = None  # (our handler, the one before it)

    @property
    def path(self) -> Path:
        """This rank's dump file."""
        return self.run_dir / DUMP_DIR / f"rank{self.rank}.json"

    def on_sigterm(self, step_of: Any) -> None:
        """Dump on SIGTERM (``step_of()``: the window in progress), then hand the signal to the
        handler that was installed before (the default one ends the process as it would have).
        Only from the main thread (where Python runs signal handlers); :meth:`release` puts the
        previous handler back."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum: int, frame: Any) -> None:
            self.dump("SIGTERM", step_of())
            self.release()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, handler)
        self._sigterm = (handler, previous)

    def release(self) -> None:
        """Put back the SIGTERM handler :meth:`on_sigterm` replaced (if still ours)."""
        pair = self._sigterm
        if pair is None or threading.current_thread() is not threading.main_thread():
            return
        handler, previous = pair
        self._sigterm = None
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    def dump(self, trigger: str, step: int) -> Path | None:
        """Write the ring now (rate-limited per trigger, see the module docstring); the path, or
        None when skipped or failed. Never raises. Cost: one host sync and the write."""
        ring = self.watch.ring
        if ring is None:
            return None
        gap = max(ring.capacity // 2, 1)
        last = self.last.get(trigger)
        if last is not None and step - last < gap:
            return None
        self.last[trigger] = step
        try:
            payload = {
                "kind": DUMP_KIND,
                "version": DUMP_VERSION,
                "rank": self.rank,
                "world_size": self.world_size,
                "trigger": trigger,
                "step": step,
                "names": ring.names,
                "modules": ring.modules,
                "rows": ring.rows(),
                "spikes": [
                    {
                        "step": e.step,
                        "loss": _f(e.loss),
                        "bound": _f(e.bound),
                        "level": _f(e.level),
                        "action": e.action,
                    }
                    for e in self.watch.events
                ],
            }
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, payload)
        except (OSError, ValueError, RuntimeError) as err:
            if not self.failed:
                warnings.warn(
                    f"the flight recorder could not write {self.path} ({err}); training goes "
                    "on without the dump",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
            self.failed = True
            return None
        self.paths.append(self.path)
        return self.path


def _f(v: float) -> float | None:
    return v if v == v and abs(v) != float("inf") else None
