"""Checkpoints for distributed runs: DDP (rank 0 writes one file) and FSDP2 (sharded, DCP).

Every rank calls :func:`save_distributed_checkpoint` / :func:`load_distributed_checkpoint` with
the same arguments. Both audit the Guard across ranks first (a desynced state is never saved) and
after loading (every rank resumed the same state). Each rank's RNG state is kept, so a resumed run
continues bitwise.

Every collective of theirs (the audit, the RNG gather, the write-status broadcast, the shard CRC
compare, DCP's own plan exchange) runs on the Guard's own group, so it waits at most
``peer_timeout``; a peer that crashed, hangs or never calls the function makes every survivor
raise :class:`CheckpointError` naming the path, with the
:class:`~ampguard.distributed.PeerFailureError` naming the ranks as its ``__cause__``
(:mod:`ampguard.checkpoint._dist_peers`). Without a distributed Guard they run on the default
group, bounded by its own timeout.

- **Replicated (DDP, plain model in a group):** rank 0 writes one file with
  :func:`ampguard.save_checkpoint` (atomic, ``weights_only`` loadable); every rank reads it.
- **FSDP2:** the tensors go through ``torch.distributed.checkpoint`` (each rank writes its shards)
  into ``PATH.tmp``; rank 0 adds ``ampguard.pt`` (Guard, scheduler, optimizer hyper-parameters,
  RNG, ``extra``: plain values, ``weights_only``) and renames the folder to ``PATH``, so ``PATH``
  is never half-written. DCP's ``.metadata`` pickle is checked against an allow-list before DCP
  reads it, so a hostile file runs no code.

>>> save_distributed_checkpoint("ckpt", model=model, optimizer=opt, guard=guard)
>>> extra = load_distributed_checkpoint("ckpt", model=model, optimizer=opt, guard=guard)
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ampguard._util.atomic import fsync_dir
from ampguard._util.stack import user_stacklevel
from ampguard.checkpoint import _dist_checks, _dist_peers, _validate
from ampguard.checkpoint._files import CheckpointError, atomic_write, verify_zip
from ampguard.checkpoint._single import _load, _save_with_crc, save_checkpoint
from ampguard.distributed import fsdp_modules, is_comm_error

__all__ = ["save_distributed_checkpoint", "load_distributed_checkpoint"]

_KEY = "__ampguard_distributed__"
_META = "ampguard.pt"
_FORMAT = "ampguard.dcp"


def save_distributed_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    guard: Any = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save on every rank (a collective); returns ``path``. Raises ``CheckpointError`` on all
    ranks if the write failed on any, or if a peer failed (its ``__cause__`` is the
    :class:`~ampguard.distributed.PeerFailureError` naming the ranks; every wait is at most
    ``peer_timeout``). Cost: the audit's host sync, one gather of RNG states, and the writes."""
    group = _dist_peers.group_of(guard)
    target = Path(path)
    with _dist_peers.bounded(guard, target, "saving the distributed checkpoint"):
        _audit(guard, "checkpoint")
        rngs = _gather_rng(group)
        if fsdp_modules(model):
            _save_sharded(target, model, _opts(optimizer), guard, scheduler, extra, rngs, group)
        else:
            info = {"world_size": dist.get_world_size(group), "kind": "replicated", "rng": rngs}
            merged = {**(extra or {}), _KEY: info}
            _on_rank0(
                group,
                lambda: save_checkpoint(
                    target,
                    model=model,
                    optimizer=optimizer,
                    guard=guard,
                    scheduler=scheduler,
                    extra=merged,
                    rng=False,
                ),
            )
    return target


def load_distributed_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    guard: Any = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Load on every rank (a collective); return ``extra``. Restores this rank's RNG state.

    Checked before anything is copied: the files' integrity (CRC-32s), every key, shape and
    dtype against the live model and optimizer, the scheduler, Guard and RNG states; a failure
    raises :class:`CheckpointError` on every rank and leaves the objects as they were (except
    that an OS error in the middle of DCP's in-place read can leave shards partly read).
    A peer that crashed, hangs or never calls this makes it raise :class:`CheckpointError` (its
    ``__cause__`` the :class:`~ampguard.distributed.PeerFailureError` naming the ranks) after
    at most ``peer_timeout``; the first collective (every rank names the same path) runs before
    anything is read, so nothing is loaded then.
    Cost: one gather of the path, reading the checkpoint, one CRC-32 pass over it shared among
    the ranks, then the audit's host sync.
    """
    group = _dist_peers.group_of(guard)
    target = Path(path)
    with _dist_peers.bounded(guard, target, "loading the distributed checkpoint"):
        _dist_peers.same_path(group, target)  # first, before any read: every rank is here
        if fsdp_modules(model):
            extra, info = _load_sharded(
                _resolve(target), model, _opts(optimizer), guard, scheduler, group
            )
        else:
            extra = dict(
                _load(
                    target,
                    model=model,
                    optimizer=optimizer,
                    guard=guard,
                    scheduler=scheduler,
                    rng=False,
                    check_extra=lambda e: _dist_checks.check_rng_info(e.get(_KEY), group, target),
                )
            )
            info = extra.pop(_KEY, None)
        _restore_rng(info, group, target)
        _audit(guard, "resume")
    return extra


# ---------------------------------------------------------------------- FSDP2 (sharded)
def _save_sharded(
    target: Path,
    model: torch.nn.Module,
    opts: list[torch.optim.Optimizer],
    guard: Any,
    scheduler: Any,
    extra: dict[str, Any] | None,
    rngs: list[dict[str, Any]],
    group: Any,
) -> None:
    import torch.distributed.checkpoint as dcp

    tmp = target.with_name(target.name + ".tmp")
    _on_rank0(group, lambda: _fresh_dir(tmp))
    tensors, plain = _split(*_state(model, opts))
    meta = {
        "format": _FORMAT,
        "plain": plain,
        "extra": extra,
        "guard": guard.state_dict() if guard is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        _KEY: {"world_size": dist.get_world_size(group), "kind": "fsdp2", "rng": rngs},
    }
    try:
        dcp.save(tensors, checkpoint_id=str(tmp), process_group=group)
    except Exception as exc:
        if is_comm_error(exc):
            raise  # a peer failed: bounded() names it
        raise CheckpointError(f"{target}: sharded write failed: {exc}") from exc

    def finish() -> None:
        # every rank's shards are written: dcp.save synced
        meta["files"] = _dist_checks.digests(tmp)
        atomic_write(tmp / _META, lambda f: _save_with_crc(meta, f))
        _swap_in(tmp, target)

    _on_rank0(group, finish)


def _load_sharded(
    target: Path,
    model: torch.nn.Module,
    opts: list[torch.optim.Optimizer],
    guard: Any,
    scheduler: Any,
    group: Any,
) -> tuple[dict[str, Any], Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    local: CheckpointError | None = None
    try:
        metadata, meta = _check_metadata(target), _read_meta(target)
    except CheckpointError as exc:  # raised on every rank by verify_files: none is left waiting
        local, meta = exc, {}
    _dist_checks.verify_files(target, meta.get("files"), group, local)
    msd, osd = _state(model, opts)
    tensors, plain = _split(msd, osd)
    # ---- check everything before DCP reads into the live tensors
    _dist_checks.check_sharded(target, metadata, meta, tensors, plain, bool(opts))
    sched_state = meta.get("scheduler") if scheduler is not None else None
    if sched_state is not None:
        _validate.check_scheduler(scheduler, sched_state, target)
    plan = None
    if guard is not None and meta.get("guard") is not None:
        try:
            plan = guard.check_state(meta["guard"])
        except ValueError as exc:
            raise CheckpointError(
                f"{target}: its Guard state does not fit this Guard: {exc}; nothing was loaded"
            ) from exc
    extra = _validate.check_extra(meta.get("extra"), target)
    _dist_checks.check_rng_info(meta.get(_KEY), group, target)
    # ---- commit
    try:
        dcp.load(tensors, checkpoint_id=str(target), process_group=group)
        msd = {**meta["plain"]["model"], **tensors["model"]}
        osd = {**meta["plain"]["optim"], **tensors["optim"]}
        set_state_dict(
            model,
            opts,
            model_state_dict=msd,
            optim_state_dict=osd or {},
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        if sched_state is not None:
            scheduler.load_state_dict(sched_state)
    except Exception as exc:
        if is_comm_error(exc):
            raise  # a peer failed: bounded() names it
        raise CheckpointError(
            f"{target}: loading failed after the checks passed; the objects "
            f"may be partly loaded: {exc}"
        ) from exc
    if plan is not None:
        guard.apply_state(plan)
    return dict(extra), meta.get(_KEY)


def _state(
    model: torch.nn.Module, opts: list[torch.optim.Optimizer]
) -> tuple[dict[str, Any], dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    if not opts:
        return get_model_state_dict(model, options=options), {}
    return get_state_dict(model, opts, options=options)


def _split(
    msd: dict[str, Any], osd: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Tensors (for DCP) apart from plain values (for the weights_only side file)."""
    tensors: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    plain: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for name, sd in (("model", msd), ("optim", osd)):
        for k, v in sd.items():
            (tensors if isinstance(v, torch.Tensor) else plain)[name][k] = v
    return tensors, plain


def _fresh_dir(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def _swap_in(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` folder to ``target``; the old one lives on until then."""
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    if old.exists():
        shutil.rmtree(old)
    fsync_dir(target.parent)


def _resolve(target: Path) -> Path:
    old = target.with_name(target.name + ".old")
    if not target.exists() and (old / _META).is_file():
        warnings.warn(
            f"{target}: missing (a save was interrupted mid-swap); loading the previous "
            f"checkpoint {old}",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return old
    return target


def _read_meta(target: Path) -> dict[str, Any]:
    file = target / _META
    if not file.is_file():
        raise CheckpointError(
            f"{target}: not a complete ampguard sharded checkpoint ({_META} is missing)"
        )
    verify_zip(file)
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{file}: unreadable (weights_only load refused or corrupt file): "
            f"{str(exc).splitlines()[0][:160]}"
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f"{file}: not an ampguard sharded checkpoint")
    return meta


class _MetadataUnpickler(pickle.Unpickler):
    """Allows only the classes DCP's ``.metadata`` is made of; anything else is refused."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = {
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) or (module, name) in self._NAMES:
                return obj
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def _check_metadata(target: Path) -> Any:
    file = target / ".metadata"
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{target}: not a sharded checkpoint (.metadata is missing)") from exc
    except Exception as exc:
        raise CheckpointError(f"{file}: refused without executing anything: {exc}") from exc


# ---------------------------------------------------------------------- shared helpers
def _opts(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def _audit(guard: Any, reason: str) -> None:
    state = getattr(guard, "distributed", None)
    if state is not None:
        state.audit(guard, reason=reason)


def _on_rank0(group: Any, action: Any) -> None:
    """Run ``action`` on the group's first rank; every rank raises if it failed there."""
    status: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            action()
        except Exception as exc:
            error = exc
            status[0] = (
                str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
            )
    src = dist.get_process_group_ranks(group)[0]
    dist.broadcast_object_list(status, src=src, group=group)
    if status[0] is not None:
        # rank 0 chains its own error (the OS error, when there is one) as the cause
        cause = error.__cause__ if isinstance(error, CheckpointError) and error.__cause__ else error
        raise CheckpointError(f"checkpoint write failed on rank {src}: {status[0]}") from cause


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _gather_rng(group: Any) -> list[dict[str, Any]]:
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, _rng_state(), group=group)
    return states


def _restore_rng(info: Any, group: Any, target: Path) -> None:
    if not isinstance(info, dict) or not isinstance(info.get("rng"), list):
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(info["rng"]) != world:
        warnings.warn(
            f"{target}: saved on {len(info['rng'])} ranks, loaded on {world}; random "
            "number generators are not restored",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return
    state = info["rng"][rank]
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
