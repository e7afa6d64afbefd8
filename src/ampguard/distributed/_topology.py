"""How a model is distributed: DDP, FSDP2 or a plain process group, detected from the model.

:func:`detect` needs no flags: ``DistributedDataParallel`` ("ddp"), FSDP2 ``fully_shard``
modules with DTensor parameters ("fsdp2"), or a plain model while a process group with more than
one rank is initialised ("process_group"). :func:`consensus_redundant` says when plain DDP
already makes every rank's own overflow check the agreed one. Cost: no collective, no sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["Topology", "consensus_redundant", "detect", "fsdp_modules", "has_dtensors"]


@dataclass(frozen=True)
class Topology:
    """How the model is distributed: ``kind`` ("ddp" | "fsdp2" | "process_group") and its group.

    ``rank``/``world_size`` are within ``group``; ``ranks`` maps group rank -> global rank.
    """

    kind: str
    group: Any
    rank: int
    world_size: int
    ranks: tuple[int, ...]

    @property
    def replicated(self) -> bool:
        """Parameters are full copies on every rank (everything but FSDP2 shards)."""
        return self.kind != "fsdp2"

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 (``fully_shard``) modules inside ``model``, outermost first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def detect(model: torch.nn.Module, process_group: Any = None) -> Topology | None:
    """The :class:`Topology` of ``model``, or None for single-process training.

    A plain model counts as distributed only when a process group with more than one rank is
    initialised; ``process_group`` overrides the group found (DDP's own, FSDP2's 1-D mesh, else
    WORLD); ``process_group="local"`` means rank-local training (e.g. an eval or EMA model on
    one rank): no consensus, no audit. Cost: no host sync.
    """
    if isinstance(process_group, str) and process_group != "local":
        raise ValueError(
            f"process_group must be None, 'local' or a ProcessGroup, got {process_group!r}"
        )
    if process_group == "local" or not (dist.is_available() and dist.is_initialized()):
        return None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        kind, group = "ddp", model.process_group
    elif fsdp_modules(model):
        kind, group = "fsdp2", _mesh_group(model)
    else:
        # WORLD is typed Optional: it is set once is_initialized() (checked above)
        kind, group = "process_group", cast(dist.ProcessGroup, dist.group.WORLD)
        if dist.get_world_size(process_group or group) < 2:
            return None
    group = process_group if process_group is not None else group
    ranks = tuple(dist.get_process_group_ranks(group))
    return Topology(kind, group, dist.get_rank(group), len(ranks), ranks)


def has_dtensors(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _mesh_group(model: torch.nn.Module) -> Any:
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1:
            return p.device_mesh.get_group()
    return dist.group.WORLD  # HSDP / 2-D meshes: every rank of the job takes part


def consensus_redundant(
    model: torch.nn.Module, topology: Topology, containment: bool, params: Sequence[torch.Tensor]
) -> bool:
    """True under plain DDP: every optimized parameter is reduced by DDP over the Guard's group.

    Then every rank steps on bitwise-equal averaged gradients (a non-finite value anywhere is
    non-finite in the average everywhere), so each rank's own found_inf is the agreed one.
    """
    if topology.kind != "ddp" or containment or not params:
        return False
    if topology.group is not getattr(model, "process_group", None):
        return False  # process_group= names another group than the one DDP reduces over
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    reduced = {
        id(p)
        for name, p in model.module.named_parameters()  # type: ignore[union-attr]
        if name not in ignored
    }
    return all(id(p) in reduced for p in params)
