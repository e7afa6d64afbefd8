"""A Guard's distributed options: validate them, detect the topology, build its state.

Also :func:`rank_telemetry`: which rank writes the run log (rank 0, or every rank whose run
folder names ``{rank}``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ampguard._util.checks import check_int
from ampguard.distributed._peers import Peers
from ampguard.distributed._state import DistributedState
from ampguard.distributed._topology import detect

__all__ = ["ON_DESYNC", "attach", "check_distributed_options", "rank_telemetry"]

ON_DESYNC = ("raise", "warn", "repair")


def attach(
    model: torch.nn.Module,
    device: torch.device,
    *,
    audit_every: int | None = 100,
    on_desync: str = "raise",
    process_group: Any = None,
    containment: bool = False,
    params: Sequence[torch.Tensor] = (),
    peer_timeout: float | None = None,
) -> DistributedState | None:
    """Validate the options and return the :class:`DistributedState`, or None (single process).

    Raises ``ValueError`` on a bad ``audit_every``/``on_desync`` even without a process group.
    """
    check_distributed_options(audit_every, on_desync)
    topology = detect(model, process_group)
    if topology is None:
        return None
    if topology.kind == "fsdp2" and containment:
        raise ValueError(
            "contain_nonfinite_microbatches=True is not supported with FSDP2 (each rank sees only "
            "its gradient shard, so ranks would drop different micro-batches); use DDP, or rely "
            "on the skipped step"
        )
    peers = None
    if peer_timeout is not None:
        peers = Peers(topology.ranks, topology.global_rank, topology.group, peer_timeout)
    return DistributedState(
        model,
        topology,
        device,
        audit_every,
        on_desync,
        peers=peers,
        containment=containment,
        params=params,
    )


def check_distributed_options(audit_every: Any, on_desync: Any) -> None:
    """``audit_every`` (an int >= 1 or None) and ``on_desync`` (one of :data:`ON_DESYNC`)."""
    check_int("audit_every", audit_every, optional=True)
    if on_desync not in ON_DESYNC:
        raise ValueError(f"on_desync must be one of {ON_DESYNC}, got {on_desync!r}")


def rank_telemetry(state: DistributedState | None, telemetry: Any) -> Any:
    """The ``telemetry=`` argument this rank keeps: rank 0 writes the run log, others nothing.

    A run-folder path containing ``{rank}`` is formatted per rank and kept on every rank (each
    rank writes its own log: "unless asked"). Under FSDP2 the per-layer statistics are those of
    the recording rank's gradient shards (telemetry runs no collective).
    """
    if state is None or telemetry is None:
        return telemetry
    if isinstance(telemetry, (str, os.PathLike)) and "{rank}" in os.fspath(telemetry):
        return os.fspath(telemetry).replace("{rank}", str(state.topology.global_rank))
    return telemetry if state.is_writer else None
