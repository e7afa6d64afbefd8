"""Rows of the cross-rank audit: build this rank's row, compare all rows, repair from rank 0.

A row is :data:`ampguard.distributed.AUDIT_FIELDS` as int64: the scale as its exact fp32 bit
pattern, the trackers, the step counters, the precision code and the parameter checksum.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ampguard.distributed import (
    AUDIT_FIELDS,
    param_checksum,
    precision_code,
    precision_name,
    scale_from_bits,
)

__all__ = ["local_row", "compare_rows", "repair"]


def local_row(guard: Any, state: Any, device: torch.device) -> torch.Tensor:
    """This rank's audit row (int64 on ``device``). Cost: one host sync (scaler state, flags)."""
    skipped = guard.skipped_steps  # settles pending fused-optimizer flags first
    scaler = guard._scaler
    if scaler is not None:
        sd = scaler.state_dict()
        scale, growth, budget = sd["scale"], sd["growth_tracker"], sd["hysteresis_tracker"]
    else:
        scale, growth, budget = 1.0, 0, 0
    values = [
        struct.unpack("<i", struct.pack("<f", scale))[0], growth, budget, guard.steps,
        guard._counts.applied, skipped, precision_code(guard.precision), 0,
    ]
    row = torch.tensor(values, dtype=torch.int64, device=device)
    params = state.replicated_params()
    if params:
        row[-1] = param_checksum(params).to(device)
    return row


def compare_rows(rows: Sequence[Sequence[int]], ranks: Sequence[int]
                 ) -> tuple[dict[str, dict[int, Any]], list[int]]:
    """``(differences, odd ranks)``: field -> {global rank: readable value} for fields that differ.

    The reference value of a field is the one most ranks hold (rank 0's on a tie); the odd ranks
    are those holding any other value.
    """
    diffs: dict[str, dict[int, Any]] = {}
    odd: set[int] = set()
    for i, name in enumerate(AUDIT_FIELDS):
        column = [row[i] for row in rows]
        if len(set(column)) == 1:
            continue
        counts = Counter(column)
        best = max(counts.values())
        reference = column[0] if counts[column[0]] == best else counts.most_common(1)[0][0]
        odd.update(r for r, v in zip(ranks, column, strict=True) if v != reference)
        diffs[name] = {r: _readable(name, v) for r, v in zip(ranks, column, strict=True)}
    return diffs, sorted(odd)


def _readable(name: str, value: int) -> Any:
    if name == "scale":
        return scale_from_bits(value)
    if name == "precision":
        return precision_name(value)
    return value


def repair(guard: Any, state: Any, reference: Sequence[int], params_differ: bool) -> None:
    """Make this rank's Guard equal to ``reference`` (rank 0's row); broadcast rank 0's params.

    Every rank calls this with the same arguments (they all saw the same rows), so the broadcasts
    match up. The caller refuses to repair a precision mismatch.
    """
    fields = dict(zip(AUDIT_FIELDS, reference, strict=True))
    if guard._scaler is not None:
        guard._scaler.load_state_dict({
            "scale": scale_from_bits(fields["scale"]),
            "growth_tracker": fields["growth_tracker"],
            "hysteresis_tracker": fields["hysteresis_tracker"],
        })
    guard._steps = fields["steps"]
    guard._counts.applied = fields["applied_steps"]
    guard._counts.skipped = fields["skipped_steps"]
    if params_differ:
        top = state.topology
        with torch.no_grad():
            for p in state.replicated_params():
                dist.broadcast(p.data, src=top.ranks[0], group=top.group)
