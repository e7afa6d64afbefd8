"""An audit checksum mismatch as a triage trigger: the replicas' parameters came apart.

The DDP audit (:meth:`ampguard.distributed.DistributedState.audit`) keeps each mismatch
(``guard.distributed.mismatches``: the step it checked, the odd ranks, the fields). That step is
a failed step for :func:`ampguard.triage`: it is replayed like any other. Replicas start a step
equal and get the same all-reduced gradients, so when the replays of the forward and backward
reproduce on every rank (no transient, no persistent fault there), the parameters came apart
outside them, in the odd rank's update or memory: a **transient fault** on that rank, at the
module owning the first parameter whose checksum differs across the ranks (one all-gather of
one int64 per parameter).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ampguard.forensics._signatures import bitsum

__all__ = ["audit_steps", "explain_audit"]


def audit_steps(guard: Any) -> dict[int, dict[str, Any]]:
    """The steps the Guard's audit found replicas apart at: step -> the mismatch record."""
    dist_state = getattr(guard, "distributed", None)
    return {int(m["step"]): m for m in getattr(dist_state, "mismatches", None) or []}


def explain_audit(event: Any, mismatch: dict[str, Any], model: torch.nn.Module) -> Any:
    """``event`` (every rank's, gathered) with the audit's evidence; when the replays found no
    fault, the transient fault on the odd rank, at the first parameter that differs across the
    ranks now. A collective: every rank calls it, in the same order. Cost: one all-gather of
    one int64 per parameter, one host sync."""
    evidence = {
        **event.evidence,
        "trigger": "audit",
        "audit_ranks": list(mismatch["ranks"]),
        "audit_fields": list(mismatch["fields"]),
    }
    name = _first_diverged(model)
    if name is not None:
        evidence["diverged_parameter"] = name
    if event.cause.endswith("_fault"):
        return replace(event, evidence=evidence)
    ranks = list(mismatch["ranks"])
    if len(ranks) != 1:  # no single odd rank: nothing to pin it on
        return replace(event, evidence=evidence)
    evidence["where"] = "the update or memory: the forward and backward reproduce on every rank"
    module = name.rpartition(".")[0] if name is not None else None
    return replace(
        event,
        cause="transient_fault",
        module=module,
        op=None,
        rank=ranks[0],
        evidence=evidence,
        phase="update",
        diagnosis=None,
    )


def _first_diverged(model: torch.nn.Module) -> str | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    named = list(inner.named_parameters())
    if not named:
        return None
    mine = torch.stack([bitsum(p).long() for _, p in named])
    device = mine.device if dist.get_backend() != "gloo" else torch.device("cpu")
    rows = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine.to(device))
    table = torch.stack(rows)
    differs = (table != table[0]).any(0).tolist()
    return next((n for (n, _), d in zip(named, differs, strict=True) if d), None)
