"""Checks for sharded (DCP) checkpoints, run before anything is read into the live tensors.

- :func:`check_sharded`: DCP's recorded keys, shapes and dtypes against the live model and
  optimizer (from its ``.metadata``; no tensor data is read).
- :func:`digests` / :func:`verify_files`: a CRC-32 of every shard file, recorded at save and
  checked at load, the files shared out among the ranks so the whole checkpoint is read once.
- :func:`check_rng_info`: this rank's saved RNG state is one torch accepts.
"""

from __future__ import annotations

import os
import stat
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ampguard.checkpoint import _validate
from ampguard.checkpoint._files import CheckpointError

__all__ = ["check_sharded", "digests", "verify_files", "check_rng_info"]

_META = "ampguard.pt"


def check_sharded(
    target: Path,
    metadata: Any,
    meta: dict[str, Any],
    tensors: dict[str, dict[str, Any]],
    plain: dict[str, dict[str, Any]],
    with_optim: bool,
) -> None:
    """DCP's recorded keys, shapes and dtypes (and the side file's plain values) fit the live
    model and optimizer; reads no tensor data."""
    stored = getattr(metadata, "state_dict_metadata", None)
    saved_plain = meta.get("plain")
    if (
        not isinstance(stored, dict)
        or not isinstance(saved_plain, dict)
        or not all(isinstance(saved_plain.get(p), dict) for p in ("model", "optim"))
    ):
        raise CheckpointError(
            f"{target}: not an ampguard sharded checkpoint (its metadata or "
            f"{_META} lacks the state dict layout)"
        )
    problems: list[str] = []
    for part in ("model", "optim") if with_optim else ("model",):
        live = {f"{part}.{k}": v for k, v in tensors[part].items()}
        ours = {k for k in stored if k.startswith(part + ".")}
        missing, unexpected = live.keys() - ours, ours - live.keys()
        if missing:
            problems.append(f"missing from the checkpoint: {_few(missing)}")
        if unexpected:
            problems.append(f"in the checkpoint but not in the live {part}: {_few(unexpected)}")
        for key in live.keys() & ours:
            got, have = stored[key], live[key]
            size, dtype = (
                getattr(got, "size", None),
                getattr(getattr(got, "properties", None), "dtype", None),
            )
            if size is None or tuple(size) != tuple(have.shape):
                problems.append(
                    f"{key!r} has shape {tuple(size) if size is not None else None} "
                    f"in the checkpoint, {tuple(have.shape)} live"
                )
            elif dtype != have.dtype:
                problems.append(f"{key!r} is {dtype} in the checkpoint, {have.dtype} live")
        got_plain, have_plain = saved_plain[part], plain[part]
        if got_plain.keys() != have_plain.keys():
            problems.append(f"{part} values differ: {_few(got_plain.keys() ^ have_plain.keys())}")
    if problems:
        raise CheckpointError(
            f"{target}: does not fit the given objects: "
            + "; ".join(problems[:8])
            + "; nothing was loaded"
        )


def _few(keys: Any) -> str:
    keys = sorted(map(str, keys))
    return ", ".join(map(repr, keys[:5])) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def digests(folder: Path) -> dict[str, list[int]]:
    """``{file: [size, crc32]}`` for the shard files DCP wrote (not the side file)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name != _META and (folder / name).is_file():
            out[name] = [(folder / name).stat().st_size, _crc32(folder / name)]
    return out


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify_files(
    target: Path, files: Any, group: Any, local: CheckpointError | None = None
) -> None:
    """Each rank checks its share of the recorded files; every rank raises if any failed.

    ``local``: this rank could not even read the metadata; it is raised here, and the others
    raise too, so no rank is left waiting in a collective. Checkpoints written before the
    digests were recorded (ampguard 0.1) are not checked."""
    problem: str | None = str(local) if local is not None else None
    if isinstance(files, dict) and problem is None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        for i, (name, digest) in enumerate(sorted(files.items(), key=lambda kv: str(kv[0]))):
            if i % world == rank and problem is None:
                problem = _file_problem(target, name, digest)
                if problem is not None:
                    problem = f"{target}: {problem}; nothing was loaded"
    problems: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    if local is not None:
        raise local
    first = next((p for p in problems if p), None)
    if first:
        raise CheckpointError(first)


def _file_problem(folder: Path, name: Any, digest: Any) -> str | None:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        return f"{_META} lists {name!r}, which is not a file of this checkpoint"
    if not (
        isinstance(digest, list)
        and len(digest) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in digest)
    ):
        return f"{_META} records {digest!r} for {name}, not [size, crc32]"
    path = folder / name
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode):  # a pipe would block the read
            return f"{name} is not a regular file"
        if st.st_size != digest[0]:
            return f"corrupt file: {name} has {st.st_size} bytes, {digest[0]} were written"
        if _crc32(path) != digest[1]:
            return (
                f"corrupt file: {name} fails its CRC-32 integrity check; it changed "
                "after it was written (disk, copy or transfer error)"
            )
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as exc:
        return f"could not read {name}: {exc}"
    return None


def check_rng_info(info: Any, group: Any, target: Path) -> None:
    """This rank's saved RNG state, if it will be restored, is one torch accepts."""
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("rng"), list)
        or len(info["rng"]) != dist.get_world_size(group)
    ):
        return
    state = info["rng"][dist.get_rank(group)]
    if not isinstance(state, dict) or not isinstance(state.get("cpu"), torch.Tensor):
        raise CheckpointError(
            f"{target}: does not fit the given objects: the saved RNG state "
            f"of rank {dist.get_rank(group)} is not a dict with a 'cpu' "
            "tensor; nothing was loaded"
        )
    cuda = state.get("cuda")
    _validate.check_rng({"cpu": state["cpu"], "cuda": None if cuda is None else [cuda]}, target)
