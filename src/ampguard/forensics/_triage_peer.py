"""Under DDP, a peer replays the same batch: which rank computes its step wrongly.

Every rank sends its failed step's batch, recorded signatures and RNG state (one
``all_gather_object``); rank ``r`` replays the batch of rank ``(r + 1) % world`` from the same
state (DDP replicas start a step equal) at the same precision and scale, and compares its
signatures with that rank's record (a second ``all_gather_object`` shares what each found).
``differs[q]`` is the first difference between rank ``q``'s record and its peer's replay of
``q``'s batch (None: they agree bit for bit).

A rank ``q`` whose own replay reproduces its record but whose record a healthy peer does not
reproduce computes wrongly every time: a **persistent fault on q**, at the module where the
peer's replay parts from ``q``'s record. ``q`` is pinned when exactly one rank fits: its record
differs from its peer's replay, the batch it replayed differs from its owner's record, and
every other record agrees (three ranks or more). With two ranks the two disagreements are
symmetric; the CPU reference of each rank's own check names which one computes wrongly, and
the peer's finding is kept as evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["culprit", "exchange", "judge"]


def _to(device: Any, value: Any) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def exchange(
    mine: dict[str, Any] | None,
    replay: Callable[[Any, Any, Any], tuple[str, str | None, str] | None] | None,
    device: Any,
) -> dict[int, Any]:
    """Every rank's ``mine`` (``batch``, ``signature``, ``rng``; None when it cannot replay)
    gathered; this rank replays its ring neighbour's with ``replay(batch, signature, rng)``
    (None: no replay here). Returns ``{q: first difference | None | "unknown"}`` for every
    rank ``q``. A collective: every rank calls it, in the same order. Cost: one replay of a
    step, two ``all_gather_object``."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    sent = None if mine is None else {**mine, "batch": _to("cpu", mine["batch"])}
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, sent)
    q = (rank + 1) % world
    found: Any = "unknown"
    if replay is not None and rows[q] is not None:
        peer = rows[q]
        diff = replay(_to(device, peer["batch"]), peer["signature"], peer["rng"])
        found = None if diff is None else list(diff)
    results: list[Any] = [None] * world
    dist.all_gather_object(results, (q, found))
    return dict(results)


def culprit(differs: dict[int, Any], world: int) -> int | None:
    """The one rank whose record its peer does not reproduce and whose replay of its peer's
    batch does not reproduce that peer's record, every other record agreeing; None when no
    rank, or more than one (two ranks), fits."""
    fits = [
        q
        for q in range(world)
        if differs.get(q) not in (None, "unknown")
        and differs.get((q + 1) % world) not in (None, "unknown")
        and all(differs.get(x) is None for x in range(world) if x not in (q, (q + 1) % world))
    ]
    return fits[0] if len(fits) == 1 else None


def judge(event: Any, differs: dict[int, Any], rank: int, world: int) -> Any:
    """This rank's ``event`` with the peer replay's evidence; a persistent fault when the peer
    replay pins this rank and its own replay reproduced its record."""
    mine = differs.get(rank, "unknown")
    evidence = {
        **event.evidence,
        "peer_replay": {
            "by": (rank - 1) % world,
            "agrees": mine is None,
            "first_difference": mine[2] if isinstance(mine, list) else None,
        },
    }
    if event.cause == "transient_fault" or culprit(differs, world) != rank:
        return replace(event, evidence=evidence)
    phase, module, _ = mine
    op = event.op if event.cause == "persistent_fault" and event.module == module else None
    evidence.update(reference="peer", replays=int(event.evidence.get("replays", 1)) + 1)
    return replace(
        event,
        cause="persistent_fault",
        module=module,
        op=op,
        rank=rank,
        evidence=evidence,
        phase=phase,
        diagnosis=None,
    )
