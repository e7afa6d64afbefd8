"""Checks of a checkpoint's payload against the live objects, before anything is copied.

:func:`ampguard.load_checkpoint` runs every check here first and copies only when all pass, so a
checkpoint that does not fit raises :class:`CheckpointError` with the model, optimizer, scheduler,
Guard and RNG exactly as they were. Every message names the file and the field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ampguard.checkpoint._files import CheckpointError

__all__ = [
    "check_model",
    "check_optimizers",
    "check_scheduler",
    "check_rng",
    "check_extra",
    "check_torch_scaler",
]

# per-parameter optimizer state that has the parameter's shape, in torch's own optimizers (other
# keys, e.g. Adafactor's factored row/col statistics, are compared with the live state if any)
_PARAM_SHAPED = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "square_avg",
        "acc_delta",
        "sum",
        "ax",
        "grad_avg",
        "prev",
        "step_size",
        "exp_inf",
    }
)


def _fail(target: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{target}: does not fit the given objects: {what}; nothing was loaded")


def _names(keys: Iterable[str], limit: int = 5) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------- model
def check_model(module: torch.nn.Module, state: Any, target: Path) -> None:
    """Same keys as ``module.state_dict()``; every tensor of the same shape and dtype."""
    if not isinstance(state, dict):
        raise _fail(target, f"its 'model' field is a {type(state).__name__}, not a state dict")
    live = module.state_dict()
    missing, unexpected = live.keys() - state.keys(), state.keys() - live.keys()
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {_names(missing)}")
    if unexpected:
        problems.append(
            f"in the checkpoint but not in {type(module).__name__}: {_names(map(str, unexpected))}"
        )
    for key, have in live.items():
        if key not in state or not isinstance(have, torch.Tensor):
            continue
        got = state[key]
        if not isinstance(got, torch.Tensor):
            problems.append(f"{key!r} is a {type(got).__name__} in the checkpoint, not a tensor")
        elif got.shape != have.shape:
            problems.append(
                f"{key!r} has shape {tuple(got.shape)} in the checkpoint, "
                f"{tuple(have.shape)} in the model"
            )
        elif got.dtype != have.dtype:
            problems.append(f"{key!r} is {got.dtype} in the checkpoint, {have.dtype} in the model")
        if len(problems) >= 8:
            break
    if problems:
        raise _fail(target, "model: " + "; ".join(problems))


# ---------------------------------------------------------------------- optimizers
def check_optimizers(
    optimizer: Any, states: Any, target: Path
) -> list[tuple[torch.optim.Optimizer, dict[str, Any]]]:
    """Pair each given optimizer with its saved state, checked; ``[]`` when none is given."""
    if optimizer is None:
        return []
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if states is None:
        raise CheckpointError(f"{target}: has no optimizer state to load; nothing was loaded")
    states = states if isinstance(states, list) else [states]
    if len(states) != len(opts):
        raise CheckpointError(
            f"{target}: holds {len(states)} optimizer state(s), "
            f"{len(opts)} optimizer(s) given; nothing was loaded"
        )
    for i, (opt, sd) in enumerate(zip(opts, states, strict=True)):
        _check_optimizer(opt, sd, target, f"optimizer[{i}]" if len(opts) > 1 else "optimizer")
    return list(zip(opts, states, strict=True))


def _check_optimizer(opt: torch.optim.Optimizer, sd: Any, target: Path, where: str) -> None:
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("state"), dict)
        or not isinstance(sd.get("param_groups"), list)
    ):
        raise _fail(
            target,
            f"{where}: not an optimizer state dict (expected a dict with 'state' "
            f"and 'param_groups', got {_shape_of(sd)})",
        )
    saved, groups = sd["param_groups"], opt.param_groups
    if len(saved) != len(groups):
        raise _fail(
            target,
            f"{where}: {len(saved)} parameter group(s) in the checkpoint, "
            f"{len(groups)} in {type(opt).__name__}",
        )
    params: dict[int, torch.Tensor] = {}
    for g, (have, got) in enumerate(zip(groups, saved, strict=True)):
        _check_group(have, got, target, f"{where} group {g}")
        for pid, p in zip(got["params"], have["params"], strict=True):
            if pid in params:
                raise _fail(target, f"{where}: parameter id {pid} appears twice")
            params[pid] = p
    for pid, entry in sd["state"].items():
        if pid not in params:
            raise _fail(target, f"{where}: state for parameter id {pid!r}, which no group holds")
        if not isinstance(entry, dict):
            raise _fail(
                target, f"{where}: state of parameter {pid} is a {type(entry).__name__}, not a dict"
            )
        _check_param_state(opt, params[pid], entry, target, f"{where} parameter {pid}")


def _check_group(have: dict[str, Any], got: Any, target: Path, where: str) -> None:
    if (
        not isinstance(got, dict)
        or not isinstance(got.get("params"), list)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in got["params"])
    ):
        raise _fail(
            target,
            f"{where}: not a parameter group (expected a dict whose 'params' "
            f"is a list of ints, got {_shape_of(got)})",
        )
    if len(got["params"]) != len(have["params"]):
        raise _fail(
            target,
            f"{where}: {len(got['params'])} parameter(s) in the checkpoint, "
            f"{len(have['params'])} in the optimizer",
        )
    for key, value in have.items():
        if key in ("params", "param_names") or key not in got:
            continue  # a key the saving torch did not know: torch fills in the default
        if not _same_kind(value, got[key]):
            raise _fail(
                target,
                f"{where}: {key!r} is {got[key]!r} in the checkpoint, the "
                f"optimizer expects a value like {value!r}",
            )


def _same_kind(have: Any, got: Any) -> bool:
    if have is None or got is None:
        return True
    if isinstance(have, bool):
        return isinstance(got, bool)
    if _is_num(have) or (isinstance(have, torch.Tensor) and have.numel() == 1):
        return _is_num(got) or (isinstance(got, torch.Tensor) and got.numel() == 1)
    if isinstance(have, (list, tuple)):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(have)
            and all(_same_kind(a, b) for a, b in zip(have, got, strict=True))
        )
    if isinstance(have, str):
        return isinstance(got, str)
    return True


def _check_param_state(
    opt: torch.optim.Optimizer, param: torch.Tensor, entry: dict[Any, Any], target: Path, where: str
) -> None:
    live = opt.state.get(param, {})
    for key, value in entry.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        expected = None
        if isinstance(live.get(key), torch.Tensor):
            expected = live[key].shape
        elif key in _PARAM_SHAPED:
            expected = param.shape
        if expected is not None and value.shape != expected:
            raise _fail(
                target,
                f"{where}: {key!r} has shape {tuple(value.shape)} in the "
                f"checkpoint, the parameter needs {tuple(expected)}",
            )


def _shape_of(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {_names(map(str, value))}"
    return f"a {type(value).__name__}"


# ---------------------------------------------------------------------- scheduler
def check_scheduler(scheduler: Any, state: Any, target: Path) -> None:
    """Keys of ``scheduler.state_dict()`` only, each value of a compatible kind."""
    if not isinstance(state, dict):
        raise _fail(
            target,
            f"scheduler: the checkpoint holds a {type(state).__name__}, not a scheduler state dict",
        )
    live = scheduler.state_dict()
    # a key the saving torch did not know keeps its current value (torch's own behaviour); an
    # unknown key would become an attribute of the scheduler (e.g. 'optimizer'): refused
    unexpected = state.keys() - live.keys()
    if unexpected:
        raise _fail(
            target,
            f"scheduler ({type(scheduler).__name__}): unexpected field(s) "
            f"{_names(map(str, unexpected))}",
        )
    for key, value in live.items():
        if (
            key in state
            and not _same_kind(value, state[key])
            or (isinstance(value, dict) and not isinstance(state[key], dict))
        ):
            raise _fail(
                target,
                f"scheduler: {key!r} is {_short(state[key])} in the checkpoint, "
                f"{type(scheduler).__name__} expects a value like {_short(value)}",
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------- RNG, extra
def check_rng(state: Any, target: Path) -> dict[str, Any] | None:
    """``None`` or ``{"cpu": ByteTensor, "cuda": [ByteTensor, ...]}`` that torch accepts."""
    if state is None:
        return None
    if not isinstance(state, dict):
        raise _fail(
            target,
            f"its 'rng' field is a {type(state).__name__}, expected a dict "
            "{'cpu': uint8 tensor, 'cuda': [uint8 tensor, ...]}",
        )
    cpu = state.get("cpu")
    if cpu is not None:
        size = torch.get_rng_state().numel()
        if not _is_byte_state(cpu) or cpu.numel() != size:
            raise _fail(
                target,
                f"rng['cpu'] is {_tensor_desc(cpu)}, torch's CPU generator "
                f"needs a uint8 tensor of {size} bytes",
            )
    cuda = state.get("cuda")
    if cuda is not None:
        if not isinstance(cuda, (list, tuple)) or not all(_is_byte_state(s) for s in cuda):
            raise _fail(target, "rng['cuda'] must be a list of uint8 tensors (one per GPU)")
        if torch.cuda.is_available() and len(cuda) > torch.cuda.device_count():
            raise _fail(
                target,
                f"rng['cuda'] holds {len(cuda)} GPU states, this process sees "
                f"{torch.cuda.device_count()} GPU(s)",
            )
    return state


def _is_byte_state(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.uint8
        and value.dim() == 1
        and value.layout == torch.strided
    )


def _tensor_desc(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def check_extra(extra: Any, target: Path) -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise _fail(target, f"its 'extra' field is a {type(extra).__name__}, not a dict")
    return extra


def check_torch_scaler(state: Any, target: Path) -> dict[str, Any] | None:
    """A plain loop's ``GradScaler.state_dict()`` to adopt, or None when there is none."""
    if state is None or (isinstance(state, dict) and not state):
        return None
    if not isinstance(state, dict) or "scale" not in state:
        raise _fail(
            target,
            f"its 'scaler' field is {_shape_of(state)}, not a torch.amp.GradScaler state dict",
        )
    scale, tracker = state["scale"], state.get("_growth_tracker", 0)
    if not (_is_num(scale) and math.isfinite(scale) and scale > 0):
        raise _fail(target, f"scaler['scale'] must be a finite number > 0, got {_short(scale)}")
    if not (isinstance(tracker, int) and not isinstance(tracker, bool) and tracker >= 0):
        raise _fail(target, f"scaler['_growth_tracker'] must be an int >= 0, got {_short(tracker)}")
    return state
