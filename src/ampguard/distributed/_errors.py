"""The exceptions of distributed training: :class:`DesyncError` and :class:`PeerFailureError`.

Re-exported by :mod:`ampguard.distributed` (their public home); here so that the audit can raise
them without importing the package that runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ampguard.findings import Finding, make

__all__ = ["DesyncError", "PeerFailureError", "DESYNC_FIX"]


class DesyncError(RuntimeError):
    """Ranks disagree on the loss-scale state, step counts or parameters.

    ``step``: the window at which the audit ran; ``differences``: field -> {rank: value};
    ``ranks``: the (global) ranks whose values differ from the majority (ties: from rank 0).
    ``finding`` is the same as an ampguard :class:`~ampguard.findings.Finding` (AG130).
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        differences: dict[str, dict[int, Any]],
        ranks: Sequence[int],
    ) -> None:
        super().__init__(message)
        self.step = step
        self.differences = differences
        self.ranks = list(ranks)

    @property
    def finding(self) -> Finding:
        return make(
            "AG130",
            message=str(self).split(" Fix: ")[0],  # the exception text ends with the fix
            step=self.step,
            evidence={
                "ranks": self.ranks,
                "differences": {
                    f: {str(r): v for r, v in vals.items()} for f, vals in self.differences.items()
                },
            },
            fix=DESYNC_FIX,
        )


class PeerFailureError(RuntimeError):
    """A collective of the Guard failed: another rank crashed, exited or timed out.

    ``ranks``: the global ranks that did not answer the roll call after the failure (empty when
    every rank answered or they could not be determined); ``step``: the window; ``what``: the
    collective that failed.
    """

    def __init__(
        self, message: str, *, ranks: Sequence[int] = (), step: int | None = None, what: str = ""
    ) -> None:
        super().__init__(message)
        self.ranks = list(ranks)
        self.step = step
        self.what = what


DESYNC_FIX = (
    "Find what the named ranks do differently (rank-dependent code around the Guard, a scale or "
    "state loaded on some ranks only, a step() skipped on one rank); resume all ranks from the "
    "same checkpoint, or use Guard(..., on_desync='repair') to copy rank 0's scaler state."
)


DesyncError.__module__ = PeerFailureError.__module__ = "ampguard.distributed"  # public home
