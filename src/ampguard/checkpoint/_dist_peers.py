"""A distributed checkpoint's collectives under ``peer_timeout``, failures named by path and rank.

:func:`group_of` is the group a checkpoint's own collectives (the RNG gather, the write-status
broadcast, the shard CRC compare, DCP's plan exchange) run on: the Guard's own group, whose
timeout is ``peer_timeout`` (:mod:`ampguard.distributed._peers`). :func:`bounded` turns a failed
collective inside its block into a :class:`~ampguard.checkpoint.CheckpointError` naming the
checkpoint's path, with the :class:`~ampguard.distributed.PeerFailureError` (naming the ranks that
did not answer the roll call) as its ``__cause__``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ampguard.checkpoint._files import CheckpointError
from ampguard.distributed import PeerFailureError, is_comm_error

__all__ = ["group_of", "bounded", "same_path"]


def group_of(guard: Any) -> Any:
    """The group for a checkpoint's collectives: the Guard's own (``timeout=peer_timeout``); the
    default group without a distributed Guard (bounded only by that group's own timeout)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "distributed checkpoints need an initialised torch.distributed group; "
            "use ampguard.save_checkpoint / load_checkpoint in one process"
        )
    state = getattr(guard, "distributed", None)
    return state.group if state is not None else dist.group.WORLD


@contextlib.contextmanager
def bounded(guard: Any, path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Run the block's collectives as ``what`` of the checkpoint at ``path``.

    A communication failure (a peer crashed, exited, or did not arrive within ``peer_timeout``)
    raises ``CheckpointError("PATH: WHAT failed: ...")`` from a :class:`PeerFailureError` naming
    the ranks (after the Guard's roll call: up to ``min(peer_timeout, 10 s)`` more). Any other
    exception passes through unchanged. Cost: none unless a collective fails.
    """
    state = getattr(guard, "distributed", None)
    step = int(getattr(guard, "steps", 0) or 0)
    inner = state.collectives(what, step) if state is not None else contextlib.nullcontext()
    try:
        with inner:
            yield
    except PeerFailureError as exc:
        raise _error(path, what, exc) from exc
    except Exception as exc:
        if not is_comm_error(exc):
            raise
        # no distributed Guard: no roll call, so the failed ranks are not known
        peer = PeerFailureError(
            f"{what} failed on rank {dist.get_rank()}: another rank probably crashed, exited "
            f"or never called the checkpoint function. Cause: {exc}",
            what=what,
        )
        peer.__cause__ = exc
        raise _error(path, what, peer) from peer


def same_path(group: Any, target: Path) -> None:
    """Every rank names the same checkpoint: one small gather, the first collective of a load,
    so a rank that never calls it fails the others (bounded) before anything is read.

    ``CheckpointError`` naming the paths when the ranks disagree. Cost: one gather of a string.
    """
    paths: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(paths, os.fspath(target), group=group)
    if len(set(paths)) > 1:
        ranks = dist.get_process_group_ranks(group)
        raise CheckpointError(
            f"{target}: the ranks load different checkpoints ("
            + ", ".join(f"rank {r}: {p!r}" for r, p in zip(ranks, paths, strict=True))
            + "); every rank must load the same one; nothing was loaded"
        )


def _error(path: str | os.PathLike[str], what: str, exc: PeerFailureError) -> CheckpointError:
    ranks = f" (rank(s) {', '.join(map(str, exc.ranks))} did not answer)" if exc.ranks else ""
    return CheckpointError(f"{os.fspath(path)}: {what} failed{ranks}: {exc}")
