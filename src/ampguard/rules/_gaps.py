"""AG140: steps a failed write (a full or read-only disk) kept out of the run log."""

from __future__ import annotations

import numpy as np

from ampguard.findings import Finding
from ampguard.rules._base import RuleConfig
from ampguard.rules._base import make_finding as _finding
from ampguard.runlog import RunLog

__all__ = ["ag140"]


def ag140(run: RunLog, cfg: RuleConfig, warm: np.ndarray) -> list[Finding]:
    """One finding per gap of ``run.unrecorded``: the other findings do not cover those steps."""
    out = []
    for gap in run.unrecorded:
        first, last = int(gap["step"]), int(gap["last"])
        reason = gap.get("reason") or "a write failed"
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        out.append(
            _finding(
                "AG140",
                "warning",
                f"{span} not recorded ({reason}): writing {gap.get('file', 'the run log')} "
                f"failed ({gap.get('error', 'no detail')}); training went on, but the skip "
                "counts, plots and findings of this report do not cover those steps.",
                first,
                {
                    "first_step": first,
                    "last_step": last,
                    "records": gap.get("records"),
                    "reason": reason,
                    "error": gap.get("error"),
                },
                "Give the run folder a disk with room (telemetry writes about 0.2-2 KB per "
                "step); Telemetry(on_write_error='raise') stops the run instead of leaving a gap.",
            )
        )
    return out
