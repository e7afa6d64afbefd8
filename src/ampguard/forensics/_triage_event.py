"""A triage verdict and its records: :class:`TriageEvent`, its finding, the ranks' merge and the
run folder's ``triage/rank<R>.json``.

:func:`ampguard.triage` decides the events (:mod:`ampguard.forensics._triage`); this module is
what an event is once decided: one failed step's cause, where it struck, its evidence, the
:class:`~ampguard.Finding` it becomes (AG380-AG383), how the ranks' events merge under
``torch.distributed`` and how they are written for ``ampguard postmortem``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampguard.findings import Finding, make
from ampguard.forensics._diagnosis import Diagnosis
from ampguard.runlog import TRIAGE_DIR, TRIAGE_KIND, TRIAGE_VERSION, write_json_atomic

__all__ = ["CAUSES", "CODES", "TriageEvent", "gathered", "plain", "write_events"]

CAUSES = ("numerics", "model_or_data", "transient_fault", "persistent_fault")
CODES = {
    "numerics": "AG380",
    "model_or_data": "AG381",
    "transient_fault": "AG382",
    "persistent_fault": "AG383",
}


@dataclass(frozen=True)
class TriageEvent:
    """One failed step's verdict.

    ``cause`` is one of :data:`CAUSES`; ``module`` the leaf module where the first wrong
    value appeared (None when the loss itself, or nothing, is to blame); ``op`` the aten op
    (persistent faults; numerics: ``locate``'s); ``rank`` the process the fault is on (the
    triaging rank for numerics and model/data); ``phase`` "forward" | "backward" | "update"
    (an audit mismatch outside both) | None;
    ``evidence`` plain JSON values; ``diagnosis`` ``locate``'s for numerics.
    """

    step: int
    cause: str
    module: str | None
    op: str | None
    rank: int
    evidence: dict[str, Any] = field(default_factory=dict)
    phase: str | None = None
    diagnosis: Diagnosis | None = None

    @property
    def code(self) -> str:
        """The finding code: AG380 numerics, AG381 model/data, AG382/AG383 faults."""
        return CODES[self.cause]

    def finding(self) -> Finding:
        """This event as a :class:`ampguard.Finding`."""
        where = " ".join(
            part
            for part in (
                f"module {self.module!r}" if self.module is not None else "",
                f"op {self.op}" if self.op else "",
                f"in {self.phase}" if self.phase else "",
                f"on rank {self.rank}",
            )
            if part
        )
        return make(
            self.code,
            f"step {self.step}: {self.cause.replace('_', ' ')} at {where}",
            detail=f"module {self.module!r}" if self.module is not None else None,
            step=self.step,
            evidence={**self.evidence, "rank": self.rank, "module": self.module, "op": self.op},
        )


def write_events(run_dir: Any, rank: int, events: list[TriageEvent]) -> None:
    """``RUN_DIR/triage/rank<R>.json`` (atomic) for ``ampguard postmortem``; nothing without a
    run folder; a failed write warns and changes nothing else."""
    if run_dir is None:
        return
    path = Path(run_dir) / TRIAGE_DIR / f"rank{rank}.json"
    payload = {
        "kind": TRIAGE_KIND,
        "version": TRIAGE_VERSION,
        "rank": rank,
        "events": [_json_safe({**plain(e), "code": e.code}) for e in events],
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, payload)
    except (OSError, ValueError) as err:
        warnings.warn(f"ag.triage could not write {path} ({err})", RuntimeWarning, stacklevel=3)


def gathered(events: list[TriageEvent]) -> list[TriageEvent]:
    """Under ``torch.distributed``: every rank's verdicts, merged (a fault on one rank is the
    run's verdict for that step); in one process, ``events`` unchanged. Cost: one
    ``all_gather_object`` under ``torch.distributed``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return events
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, [plain(e) for e in events])
    by_step: dict[int, TriageEvent] = {}
    for rank_events in rows:
        for e in rank_events:
            ev = TriageEvent(**e)
            seen = by_step.get(ev.step)
            if seen is None or (ev.cause.endswith("_fault") and not seen.cause.endswith("_fault")):
                by_step[ev.step] = ev
    return [by_step[s] for s in sorted(by_step)]


def _json_safe(value: Any) -> Any:
    """NaN/inf as None (the run folder's JSON is strict), containers kept."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def plain(event: TriageEvent) -> dict[str, Any]:
    """``event``'s fields as plain values (its ``diagnosis`` left out)."""
    return {
        "step": event.step,
        "cause": event.cause,
        "module": event.module,
        "op": event.op,
        "rank": event.rank,
        "evidence": event.evidence,
        "phase": event.phase,
    }


TriageEvent.__module__ = "ampguard.forensics"  # its public home: repr and pickles name that path
