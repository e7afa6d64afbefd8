"""Rows of the cross-rank audit: build this rank's row, compare all rows, repair from rank 0.

A row is :data:`AUDIT_FIELDS` as int64: the scale as its exact fp32 bit
pattern, the trackers, the step counters, the precision code and the parameter checksum.
"""

from __future__ import annotations

import struct
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ampguard import precisions
from ampguard._util.stack import user_stacklevel
from ampguard.distributed._checksum import param_checksum
from ampguard.distributed._errors import DESYNC_FIX as _DESYNC_FIX
from ampguard.distributed._errors import DesyncError

__all__ = ["AUDIT_FIELDS", "run_audit", "local_row", "compare_rows", "repair"]

AUDIT_FIELDS = (
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "steps",
    "applied_steps",
    "skipped_steps",
    "precision",
    "param_checksum",
)


def run_audit(state: Any, guard: Any, reason: str) -> dict[str, dict[int, Any]]:
    """One audit for :meth:`DistributedState.audit`: gather the rows, compare, act."""
    top = state.topology
    n = len(AUDIT_FIELDS)
    # the row, then this rank's overflow-origin counters (gathered, not compared)
    table = torch.zeros(top.world_size, n + 3, dtype=torch.int64, device=state.device)
    table[top.rank, :n] = local_row(guard, state, state.device)
    table[top.rank, n:] = state.origin_columns().to(state.device)
    with state.collectives("the cross-rank audit", guard.steps):
        dist.all_reduce(table, group=state.group)
    state.adopt_origin(table[:, n:], guard.steps)
    rows = table[:, :n].tolist()
    state.audits += 1
    diffs, odd = compare_rows(rows, top.ranks)
    if not diffs:
        return diffs
    # the window the audit checked is a failed step for ampguard.triage (numbered as its
    # forward saw guard.steps), kept before any raise or repair
    state.mismatches.append({"step": guard.steps - 1, "ranks": odd, "fields": sorted(diffs)})
    message = _desync_message(guard.steps, reason, state.audit_every, diffs, odd)
    unrepairable = state.on_desync == "repair" and "precision" in diffs
    if state.on_desync == "raise" or unrepairable:
        raise DesyncError(message, step=guard.steps, differences=diffs, ranks=odd)
    if state.on_desync == "repair":
        repair(guard, state, rows[0], "param_checksum" in diffs)
        message += " Repaired: rank 0's scaler state and counters were copied to every rank"
        message += (
            " and its parameters broadcast (optimizer state was not)."
            if "param_checksum" in diffs
            else "."
        )
    warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())
    return diffs


def local_row(guard: Any, state: Any, device: torch.device) -> torch.Tensor:
    """This rank's audit row (int64 on ``device``). Cost: one host sync (scaler state, flags)."""
    skipped = guard.skipped_steps  # settles pending fused-optimizer flags first
    sd = guard.scaler_state()
    if sd is not None:
        scale, growth, budget = sd["scale"], sd["growth_tracker"], sd["hysteresis_tracker"]
    else:
        scale, growth, budget = 1.0, 0, 0
    values = [
        struct.unpack("<i", struct.pack("<f", scale))[0],
        growth,
        budget,
        guard.steps,
        guard.applied_steps,
        skipped,
        precision_code(guard.precision),
        0,
    ]
    row = torch.tensor(values, dtype=torch.int64, device=device)
    params = state.replicated_params()
    if params:
        row[-1] = param_checksum(params).to(device)
    return row


def compare_rows(
    rows: Sequence[Sequence[int]], ranks: Sequence[int]
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
    guard.restore_counts(
        steps=fields["steps"],
        applied=fields["applied_steps"],
        skipped=fields["skipped_steps"],
        scaler_state={
            "scale": scale_from_bits(fields["scale"]),
            "growth_tracker": fields["growth_tracker"],
            "hysteresis_tracker": fields["hysteresis_tracker"],
        },
    )
    if params_differ:
        top = state.topology
        with torch.no_grad(), state.collectives("the audit's repair broadcast", guard.steps):
            for p in state.replicated_params():
                dist.broadcast(p.data, src=top.ranks[0], group=state.group)


def _desync_message(
    step: int, reason: str, every: int | None, diffs: dict[str, dict[int, Any]], odd: list[int]
) -> str:
    when = f"every {every} steps" if every else "audit"
    parts = []
    for field_name, values in diffs.items():
        groups: dict[Any, list[int]] = {}
        for r, v in values.items():
            groups.setdefault(v, []).append(r)
        parts.append(
            f"{field_name}: "
            + "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} = {_fmt(v)}"
                for v, rs in groups.items()
            )
        )
    return (
        f"ranks out of sync at step {step} ({reason} audit, {when}): rank(s) "
        f"{', '.join(map(str, odd))} differ. " + " | ".join(parts) + ". Fix: " + _DESYNC_FIX
    )


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def scale_from_bits(bits: int) -> float:
    """The fp32 value whose bit pattern is ``bits`` (audit rows store the scale exactly)."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def precision_name(code: int) -> str:
    """The precision a rank's audit row names (its registry entry's ``audit_code``)."""
    return precisions.by_audit_code(code)


def precision_code(name: str) -> int:
    """The stable code of precision ``name`` that crosses ranks in the audit row."""
    return precisions.REGISTRY[name].audit_code
