"""One-file checkpoints: :func:`save_checkpoint` and :func:`load_checkpoint` (see the package).

The format tag and version, the atomic write and the all-or-nothing load; the sharded
checkpoint of a distributed run is :mod:`ampguard.checkpoint.distributed`.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ampguard._util.stack import user_stacklevel
from ampguard.checkpoint import _validate
from ampguard.checkpoint._files import CheckpointError, atomic_write, is_zip, verify_zip

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "atomic_write"]

_FORMAT = "ampguard.checkpoint"
_VERSION = 1
# exact types: a str/int subclass (e.g. torch's TorchVersion) would be refused by weights_only
_SCALARS = (str, int, float, bool, type(None))
_OBJECTS = (torch.Tensor, torch.dtype, torch.device, torch.Size)


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
    loads with ``weights_only=True`` (``TypeError`` at the call otherwise). Any failure to write,
    the OS error included (chained as the cause), is a :class:`CheckpointError` naming ``path``;
    the previous file stays. Cost: one host sync (the Guard's state), plus the copy of device
    tensors that ``torch.save`` makes, an fsync, and a listing of the folder (stale temporaries).
    """
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    _check_plain(extra, "extra")
    target = Path(path)
    try:
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
    except OSError as exc:  # the Guard's state flushes its run log first
        raise CheckpointError(
            f"{target}: could not be written: collecting the state failed: {exc}"
        ) from exc
    atomic_write(target, lambda f: _save_with_crc(payload, f))
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

    All or nothing: the file's integrity (the CRC-32 of every zip member) and then every field
    (model keys, shapes and dtypes, optimizer groups and state, scheduler, Guard state, RNG
    state) are checked before anything is copied, so any failure raises :class:`CheckpointError`
    naming the path and the reason and leaves every given object as it was. Always
    ``weights_only=True``. A checkpoint without Guard state (e.g. from a plain torch loop) loads
    with a warning that the loss scale restarts at ``init_scale``; a torch ``GradScaler`` state
    under ``"scaler"`` is adopted instead. Cost: the CRC-32 pass over the file (README), plus
    one host sync per Guard state.
    """
    return _load(
        Path(path), model=model, optimizer=optimizer, guard=guard, scheduler=scheduler, rng=rng
    )


def _load(
    target: Path,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    guard: Any,
    scheduler: Any,
    rng: bool,
    check_extra: Any = None,
) -> dict[str, Any]:
    """:func:`load_checkpoint`; ``check_extra(extra)`` joins the checks (distributed RNG)."""
    data = _normalise(_read(target), target)
    foreign = bool(data.get("foreign"))
    module = _unwrap(model)
    # ---- check everything; nothing is changed until all of it passed
    _validate.check_model(module, data.get("model"), target)
    pairs = _validate.check_optimizers(optimizer, data.get("optimizer"), target)
    sched_state = data.get("scheduler") if scheduler is not None else None
    if sched_state is not None:
        _validate.check_scheduler(scheduler, sched_state, target)
    guard_plan = _check_guard(guard, data, target)
    rng_state = _check_rng(data.get("rng"), target, foreign) if rng else None
    extra = _validate.check_extra(data.get("extra"), target)
    if check_extra is not None:
        check_extra(extra)
    # ---- commit
    try:
        for opt, sd in pairs:
            opt.load_state_dict(sd)
        module.load_state_dict(data["model"])
        if sched_state is not None:
            scheduler.load_state_dict(sched_state)
    except Exception as exc:  # a custom load hook refused what the checks accepted
        raise CheckpointError(
            f"{target}: loading failed after the checks passed (a custom "
            f"load_state_dict hook?); the objects may be partly loaded: "
            f"{exc}"
        ) from exc
    if guard is not None:
        _commit_guard(guard, guard_plan, target)
    if rng_state is not None:
        _set_rng_state(rng_state)
    return extra


def _save_with_crc(payload: dict[str, Any], f: Any) -> None:
    """``torch.save`` with its per-member CRC-32s on: :func:`verify_zip` checks them at load."""
    from torch.serialization import get_crc32_options, set_crc32_options

    was_on = get_crc32_options()
    if not was_on:
        set_crc32_options(True)
    try:
        torch.save(payload, f)
    finally:
        if not was_on:
            set_crc32_options(False)


# ---------------------------------------------------------------------- reading
def _read(target: Path) -> Any:
    if target.is_dir():
        raise CheckpointError(f"{target}: is a folder, not a checkpoint file")
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{target}: no such checkpoint file") from None
    except OSError as exc:
        raise CheckpointError(f"{target}: could not be read: {exc}") from exc
    if not stat.S_ISREG(mode):  # a pipe or a device would block or never end
        raise CheckpointError(f"{target}: not a regular file (a device, pipe or socket)")
    try:
        zipped = is_zip(target)
    except OSError as exc:
        raise CheckpointError(f"{target}: could not be read: {exc}") from exc
    if zipped:
        verify_zip(target)
    try:
        data = torch.load(target, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"{target}: could not be read: {exc}") from exc
    except Exception as exc:  # torch raises many types for bad files; all mean "unreadable"
        raise CheckpointError(f"{target}: unreadable checkpoint: {_reason(exc)}") from exc
    if not zipped:
        warnings.warn(
            f"{target}: torch's legacy (pre-1.6, non-zip) format carries no "
            "checksums; loaded without an integrity check",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
    return data


def _reason(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    # torch's weights_only message: a generic first line, the specific cause further down
    detail = next((ln for ln in lines if "GLOBAL" in ln), None)
    if detail:
        return (
            f"it references code or objects that weights_only loading refuses "
            f"({detail[:160]}); refused without executing anything"
        )
    if lines and lines[0].startswith("Weights only load failed"):
        # e.g. "Unsupported operand 149": random bytes, or a protocol-4+ pickle (STACK_GLOBAL)
        detail = next(
            (ln for ln in lines[1:] if not ln.startswith(("Please file", "Check the"))),
            "unsupported pickle content",
        )
        return (
            f"corrupt, or a pickle that weights_only loading refuses ({detail[:160]}); "
            "refused without executing anything"
        )
    detail = lines[0] if lines else type(exc).__name__
    return f"corrupt or truncated file ({detail[:160]})"


def _normalise(data: Any, target: Path) -> dict[str, Any]:
    """Accept ampguard's format or a plain torch loop's ``{"model": ..., ...}`` dict."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{target}: not a checkpoint (top level is {type(data).__name__})")
    if data.get("format") == _FORMAT:
        if data.get("version") != _VERSION:
            raise CheckpointError(
                f"{target}: unsupported ampguard checkpoint version "
                f"{data.get('version')!r} (this ampguard reads {_VERSION})"
            )
        return data
    for key in ("model", "model_state_dict", "state_dict"):
        if isinstance(data.get(key), dict):
            out = dict(data)
            out["model"] = data[key]
            out["optimizer"] = data.get("optimizer", data.get("optimizer_state_dict"))
            out["extra"] = None
            out["foreign"] = True
            return out
    raise CheckpointError(
        f"{target}: not a checkpoint ampguard understands (keys: "
        f"{sorted(map(str, data))[:8]}); expected a 'model' state dict"
    )


def _check_guard(guard: Any, data: dict[str, Any], target: Path) -> tuple[str, Any]:
    """What loading into ``guard`` will do: ``(kind, checked value)``; changes nothing."""
    if guard is None:
        return ("none", None)
    state = data.get("guard")
    if state is not None:
        try:
            return ("state", guard.check_state(state))
        except ValueError as exc:
            raise CheckpointError(
                f"{target}: its Guard state does not fit this Guard: {exc}; nothing was loaded"
            ) from exc
    if not guard.uses_scaler:  # bf16 / fp32: no loss scale to restore
        return ("restart", None)
    scaler_state = _validate.check_torch_scaler(data.get("scaler"), target)
    return ("adopt", scaler_state) if scaler_state is not None else ("restart warn", None)


def _commit_guard(guard: Any, plan: tuple[str, Any], target: Path) -> None:
    kind, value = plan
    try:
        if kind == "state":
            guard.apply_state(value)
        elif kind == "restart":
            guard.restart_scale()
        elif kind == "adopt":
            guard.adopt_torch_scaler_state(value)
            warnings.warn(
                f"{target}: no ampguard Guard state; adopted the torch GradScaler "
                f"state (scale {value['scale']:g})",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        elif kind == "restart warn":
            warnings.warn(
                f"{target}: checkpoint has no loss-scaler state (saved by a plain loop without "
                "scaler.state_dict()); the loss scale restarts at init_scale="
                f"{guard.scaler_config.init_scale:g} and will probe its level again (AG107). "
                "Consider a lower learning rate for a few hundred steps.",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
            guard.restart_scale()
    except OSError as exc:  # the Guard's run log (telemetry) could not be continued
        raise CheckpointError(
            f"{target}: loaded, but the Guard's run log could not record the resume: {exc}"
        ) from exc


def _check_rng(state: Any, target: Path, foreign: bool) -> dict[str, Any] | None:
    try:
        return _validate.check_rng(state, target)
    except CheckpointError:
        if not foreign:
            raise
    # a plain loop's own 'rng' field, in its own format: not ours to interpret
    warnings.warn(
        f"{target}: its 'rng' field is not in ampguard's format; the random number "
        "generators were not restored",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
    return None


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
