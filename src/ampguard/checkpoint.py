"""Safe checkpoints: atomic save, ``weights_only`` load, resume checks.

A checkpoint is written to a temporary file in the target folder, fsynced and atomically renamed
over the target, so a crash at any moment leaves either the old or the new checkpoint, never a torn
one. Loading always uses ``torch.load(weights_only=True)``: no code from the file ever runs.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "atomic_write"]

_FORMAT = "ampguard.checkpoint"
_VERSION = 1
# exact types: a str/int subclass (e.g. torch's TorchVersion) would be refused by weights_only
_SCALARS = (str, int, float, bool, type(None))
_OBJECTS = (torch.Tensor, torch.dtype, torch.device, torch.Size)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the reason."""


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    guard: Any = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
) -> Path:
    """Atomically write model, optimizer(s), Guard, scheduler, RNG state and ``extra`` to ``path``.

    ``extra`` must hold plain values (tensors, numbers, strings, lists/dicts of them) so the file
    loads with ``weights_only=True``. Cost: one host sync (the Guard's state), plus the copy of
    device tensors that ``torch.save`` makes.
    """
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    _check_plain(extra, "extra")
    payload: dict[str, Any] = {
        "format": _FORMAT,
        "version": _VERSION,
        "torch_version": str(torch.__version__),
        "model": _unwrap(model).state_dict(),
        "optimizer": _optimizer_states(optimizer),
        "guard": guard.state_dict() if guard is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra": extra,
        "rng": _rng_state() if rng else None,
    }
    target = Path(path)
    atomic_write(target, lambda f: torch.save(payload, f))
    return target


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    guard: Any = None,
    scheduler: Any = None,
    rng: bool = True,
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote (or a plain torch loop's dict); return ``extra``.

    Always ``weights_only=True``. A truncated, corrupt, foreign or malicious file raises
    :class:`CheckpointError` naming the path and the reason. A checkpoint without Guard state
    (e.g. from a plain torch loop) loads with a warning that the loss scale restarts at
    ``init_scale``; a torch ``GradScaler`` state under ``"scaler"`` is adopted instead.
    """
    target = Path(path)
    data = _read(target)
    data = _normalise(data, target)
    try:
        _unwrap(model).load_state_dict(data["model"])
        _load_optimizers(optimizer, data.get("optimizer"), target)
        if scheduler is not None and data.get("scheduler") is not None:
            scheduler.load_state_dict(data["scheduler"])
        if guard is not None:
            _load_guard(guard, data, target)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{target}: does not fit the given objects: {exc}") from exc
    if rng and data.get("rng") is not None:
        _set_rng_state(data["rng"])
    return data.get("extra") or {}


def atomic_write(target: Path, write: Any) -> None:
    """Call ``write(fileobj)`` on a temp file beside ``target``, fsync, then rename over it.

    A crash at any moment leaves the previous ``target`` intact. Raises :class:`CheckpointError`.
    """
    target = Path(target)
    folder = target.parent if str(target.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(folder)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, Exception):
            raise CheckpointError(f"{target}: could not be written: {exc}") from exc
        raise


# ---------------------------------------------------------------------- reading
def _read(target: Path) -> Any:
    if not target.is_file():
        raise CheckpointError(f"{target}: no such checkpoint file")
    try:
        return torch.load(target, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for bad files; all mean "unreadable"
        raise CheckpointError(f"{target}: unreadable checkpoint: {_reason(exc)}") from exc


def _reason(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    # torch's weights_only message: a generic first line, the specific cause further down
    detail = next((ln for ln in lines if "GLOBAL" in ln), None)
    if detail:
        return (f"it references code or objects that weights_only loading refuses "
                f"({detail[:160]}); refused without executing anything")
    if lines and lines[0].startswith("Weights only load failed"):
        # e.g. "Unsupported operand 149": random bytes, or a protocol-4+ pickle (STACK_GLOBAL)
        detail = next((ln for ln in lines[1:] if not ln.startswith(("Please file", "Check the"))),
                      "unsupported pickle content")
        return (f"corrupt, or a pickle that weights_only loading refuses ({detail[:160]}); "
                "refused without executing anything")
    detail = lines[0] if lines else type(exc).__name__
    return f"corrupt or truncated file ({detail[:160]})"


def _normalise(data: Any, target: Path) -> dict[str, Any]:
    """Accept ampguard's format or a plain torch loop's ``{"model": ..., ...}`` dict."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{target}: not a checkpoint (top level is {type(data).__name__})")
    if data.get("format") == _FORMAT:
        if data.get("version") != _VERSION:
            raise CheckpointError(f"{target}: unsupported ampguard checkpoint version "
                                  f"{data.get('version')!r} (this ampguard reads {_VERSION})")
        return data
    for key in ("model", "model_state_dict", "state_dict"):
        if isinstance(data.get(key), dict):
            out = dict(data)
            out["model"] = data[key]
            out["optimizer"] = data.get("optimizer", data.get("optimizer_state_dict"))
            out["extra"] = None
            out["foreign"] = True
            return out
    raise CheckpointError(f"{target}: not a checkpoint ampguard understands (keys: "
                          f"{sorted(map(str, data))[:8]}); expected a 'model' state dict")


def _load_optimizers(optimizer: Any, states: Any, target: Path) -> None:
    if optimizer is None:
        return
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if states is None:
        raise CheckpointError(f"{target}: has no optimizer state to load")
    states = states if isinstance(states, list) else [states]
    if len(states) != len(opts):
        raise CheckpointError(f"{target}: holds {len(states)} optimizer state(s), "
                              f"{len(opts)} optimizer(s) given")
    for opt, sd in zip(opts, states, strict=True):
        opt.load_state_dict(sd)


def _load_guard(guard: Any, data: dict[str, Any], target: Path) -> None:
    state = data.get("guard")
    if state is not None:
        guard.load_state_dict(state)
        return
    scaler_state = data.get("scaler")
    if not guard.uses_scaler:  # bf16 / fp32: no loss scale to restore
        guard._restart_scale()
        return
    if isinstance(scaler_state, dict) and "scale" in scaler_state:
        guard._adopt_torch_scaler_state(scaler_state)
        warnings.warn(f"{target}: no ampguard Guard state; adopted the torch GradScaler state "
                      f"(scale {scaler_state['scale']:g})", RuntimeWarning, stacklevel=3)
        return
    warnings.warn(
        f"{target}: checkpoint has no loss-scaler state (saved by a plain loop without "
        "scaler.state_dict()); the loss scale restarts at init_scale="
        f"{guard.scaler_config.init_scale:g} and will probe its level again (AG107). Consider a "
        "lower learning rate for a few hundred steps.",
        RuntimeWarning, stacklevel=3,
    )
    guard._restart_scale()


# ---------------------------------------------------------------------- helpers
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _optimizer_states(optimizer: Any) -> Any:
    if optimizer is None:
        return None
    if isinstance(optimizer, (list, tuple)):
        return [opt.state_dict() for opt in optimizer]
    return optimizer.state_dict()


def _check_plain(value: Any, where: str) -> None:
    if type(value) in _SCALARS or isinstance(value, _OBJECTS):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where} has a key of type {type(k).__name__}; use str or int")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"{where} holds a {type(value).__name__}, which weights_only loading refuses; store plain "
        "values (tensors, numbers, strings, lists and dicts of them)"
    )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    if isinstance(state.get("cpu"), torch.Tensor):
        torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(folder: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
