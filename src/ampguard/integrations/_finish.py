"""End of a framework run: close the watch, write the report, surface serious findings."""

from __future__ import annotations

import warnings
from typing import Any

from ampguard._util.stack import user_stacklevel
from ampguard.findings import Finding

__all__ = ["close_and_report"]


def close_and_report(handle: Any, report: bool) -> list[Finding]:
    """Close ``handle`` (a :class:`~ampguard.integrations.watch.Watch`), write ``report.html``
    when ``report``, warn once if there are warning/error findings; return the findings.

    A missing optional dependency of the report (matplotlib) is a warning, not an error: the
    training is over and its run log is already complete. Cost: one host sync (the flush).
    """
    handle.close()
    found = handle.findings()
    if report:
        try:
            handle.report()
        except ImportError as exc:
            warnings.warn(
                f"ampguard: no report written ({exc})", RuntimeWarning, stacklevel=user_stacklevel()
            )
    serious = [f for f in found if f.severity in ("warning", "error")]
    if serious:
        codes = ", ".join(sorted({f.code for f in serious}))
        where = handle.run_dir
        warnings.warn(
            f"ampguard: {len(serious)} finding(s) ({codes}); see {where}/report.html "
            f"or `ampguard report {where}`",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
    return found
