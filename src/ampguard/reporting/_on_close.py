"""``report.html`` at the end of a Guard's run, as the framework integrations write it.

A missing matplotlib is a one-line note, not an error: the training is over and its run log is
complete (``ampguard report RUN`` renders it later). A folder without ``meta.json`` holds no run
log and gets no report.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from ampguard import runlog
from ampguard._util.stack import user_stacklevel

__all__ = ["write_report"]


def write_report(run_dir: str | os.PathLike) -> Path | None:
    """Write ``run_dir/report.html``; None when there is nothing to report or no matplotlib.

    Cost: no host sync (reads the closed run log); rendering the figures takes about a second.
    """
    if not (Path(run_dir) / runlog.META).exists():
        return None  # no run log here (the telemetry never started one)
    try:
        from ampguard.reporting._report import report

        return report(run_dir)
    except ImportError:
        warnings.warn(
            f"ampguard: no report.html written for {run_dir} (needs matplotlib: pip "
            "install 'ampguard[report]'); `ampguard report` renders it later",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return None
    except OSError as exc:  # a full or read-only disk: the run log is what matters
        warnings.warn(
            f"ampguard: no report.html written for {run_dir} ({exc}); `ampguard report` "
            "renders it later",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
