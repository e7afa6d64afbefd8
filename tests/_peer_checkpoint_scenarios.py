"""What each rank runs in tests/test_peer_checkpoints.py: failing peers around distributed
checkpoints and around building the Guard's own group.

The scenarios are registered into :data:`_distributed_scenarios.SCENARIOS`; :func:`run_group`
spawns ranks whose entry point is this module's, so they import these scenarios too.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import _distributed_scenarios as S
import torch

import ampguard as ag
from ampguard.checkpoint.distributed import load_distributed_checkpoint, save_distributed_checkpoint

PEER = 1.5  # peer_timeout (the roll call then waits 3 s, its minimum)
SLEEP = 9.0  # a hung rank's pause: longer than peer_timeout + roll call


def run_group(
    world: int, scenarios: list[str], timeout: float = 90.0, pg_timeout: float = 30.0
) -> dict[str, dict[int, tuple[str, Any]]]:
    """:func:`_distributed_scenarios.run_group` with this module's entry point."""
    tmp = tempfile.mkdtemp(prefix="ampguard-peers-")
    return S.run_ranks(_main, world, scenarios, timeout, tmp, pg_timeout)


def _main(*args: Any) -> None:
    S._rank_main(*args)


def _trained(kind: str, rank: int, world: int, **kwargs: Any) -> tuple[Any, Any, ag.Guard]:
    model = {"ddp": S.ddp, "fsdp2": S.fsdp2}[kind](S.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="fp16", scaler=S.SCALE, peer_timeout=PEER, **kwargs)
    S.window(guard, model, 1, rank, world)
    return model, opt, guard


def _outcome(call: Any) -> dict[str, Any]:
    """Run ``call``; the error's type, message, cause and how long it took."""
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test asserts on what it was
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "cause": type(cause).__name__ if cause is not None else None,
            "ranks": getattr(cause, "ranks", getattr(exc, "ranks", None)),
            "seconds": time.monotonic() - started,
        }
    return {"error": None, "seconds": time.monotonic() - started}


def save_with_a_crashed_peer_ddp(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """DDP: the last rank dies just before the save; the others must not hang in the audit."""
    model, opt, guard = _trained("ddp", rank, world)
    if rank == world - 1:
        os._exit(3)
    path = os.path.join(tmp, "ddp.pt")
    return _outcome(
        lambda: save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    ) | {"path": path, "exists": os.path.exists(path)}


def save_with_a_hung_peer_fsdp2(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """FSDP2, no audits: the last rank pauses before the save; the first collective the others
    meet is the RNG gather, which must fail after peer_timeout (not the group's 30 s)."""
    model, opt, guard = _trained("fsdp2", rank, world, audit_every=None)
    guard.distributed.audit = lambda *a, **k: {}  # type: ignore[method-assign] - skip to the gather
    path = os.path.join(tmp, "fsdp2-save")
    if rank == world - 1:
        time.sleep(SLEEP)
    return _outcome(
        lambda: save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    ) | {"path": path, "exists": os.path.exists(path)}


def load_with_an_absent_peer_fsdp2(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """FSDP2: a checkpoint is saved; the last rank then never calls load (it sleeps and leaves).
    The others must raise after peer_timeout, with nothing loaded."""
    model, opt, guard = _trained("fsdp2", rank, world)
    path = os.path.join(tmp, "fsdp2-load")
    save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    if rank == world - 1:
        time.sleep(SLEEP)
        return {"error": None}
    with torch.no_grad():  # local edits (a window would need the absent rank)
        for p in model.parameters():
            p.to_local().add_(1.0)
    before = [p.to_local().clone() for p in model.parameters()]
    out = _outcome(
        lambda: load_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    )
    after = [p.to_local() for p in model.parameters()]
    return out | {
        "path": path,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
    }


def load_with_an_absent_peer_ddp(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """DDP: as above; the survivor must raise before reading anything (nothing loaded)."""
    model, opt, guard = _trained("ddp", rank, world)
    path = os.path.join(tmp, "ddp-load.pt")
    save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    if rank == world - 1:
        time.sleep(SLEEP)
        return {"error": None}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = [p.detach().clone() for p in model.parameters()]
    out = _outcome(
        lambda: load_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    )
    after = list(model.parameters())
    return out | {
        "path": path,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
    }


def load_different_paths_ddp(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """DDP: each rank names its own checkpoint file: refused on every rank, nothing loaded."""
    model, opt, guard = _trained("ddp", rank, world)
    path = os.path.join(tmp, f"own-{rank}.pt")
    save_distributed_checkpoint(
        os.path.join(tmp, "shared.pt"), model=model, optimizer=opt, guard=guard
    )
    if rank == 0:
        import shutil

        for r in range(world):
            shutil.copy(os.path.join(tmp, "shared.pt"), os.path.join(tmp, f"own-{r}.pt"))
    guard.distributed.audit(guard)  # a collective: the copies exist before anyone loads
    return _outcome(
        lambda: load_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    )


def guard_group_with_an_absent_peer(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """No peer_timeout given: it defaults to the group's own (the test's pg_timeout). The last
    rank's second Guard() raises (a bad argument) before building its group; the others' second
    Guard() must raise PeerFailureError naming it after that timeout, not wait 30 minutes."""
    model = S.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = ag.Guard(model, opt, precision="fp16")
    resolved = first.peer_timeout
    if rank == world - 1:
        ag.Guard(model, opt, precision="fp16", audit_every=0)  # raises ValueError: process ends
    return _outcome(lambda: ag.Guard(model, opt, precision="fp16")) | {"peer_timeout": resolved}


for _f in (
    save_with_a_crashed_peer_ddp,
    save_with_a_hung_peer_fsdp2,
    load_with_an_absent_peer_fsdp2,
    load_with_an_absent_peer_ddp,
    load_different_paths_ddp,
    guard_group_with_an_absent_peer,
):
    S.SCENARIOS[_f.__name__] = _f
