"""``locate``: replay one batch in low precision and in fp32, traced op by op, and diagnose it.

The replays run here (:mod:`ampguard.forensics._replay`); what their traces say is
:mod:`ampguard.forensics._classify`'s part, the answer a :class:`~ampguard.forensics.Diagnosis`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ampguard._util.checks import check_finite
from ampguard.core.policy import device_of, resolve_precision
from ampguard.forensics import _optimizer
from ampguard.forensics._classify import (
    at_first_new,
    broken_state,
    classify_low,
    first_new,
    input_nonfinite,
    rows,
    silent,
    with_poisoned_buffers,
)
from ampguard.forensics._diagnosis import Diagnosis
from ampguard.forensics._fixcheck import check_keep_fp32, tiny_eps
from ampguard.forensics._limits import FULL, LOW_DTYPES, MAX, REPLAYABLE
from ampguard.forensics._lowp import emulated_format, emulating
from ampguard.forensics._replay import Preserved, Run, nonfinite_leaves, replay
from ampguard.forensics._silent import grad_errors

__all__ = ["locate"]


def locate(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    precision: str = "fp16",
    scale: float | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    ema: Any = None,
    ema_decay: float = 0.999,
    rng_state: dict[str, Any] | torch.Tensor | None = None,
) -> Diagnosis:
    """Find the module and op where ``batch`` first goes non-finite, and classify why.

    ``loss_fn(model, batch)`` returns the scalar loss. The batch runs like a training step in
    ``precision`` ("fp16" | "bf16" | "auto", or a low-precision format: "fp8" | "mxfp8" |
    "nvfp4" | "fp8_blockwise", replayed with every Linear layer that fits the format emulated in
    it under bf16 autocast, ``stats["emulated"]`` naming them; "fp8" is torchao float8's
    tensorwise recipe) with the backward of ``loss * scale`` (default
    ``2**16`` under fp16, as ``torch.amp.GradScaler`` starts; 1 under bf16), then in fp32, and,
    for a backward overflow, once more at scale 1 to tell a scaler probe from a real overflow.
    Parameters, buffers, gradients, RNG state and training modes are restored afterwards and
    no hook is left behind. ``rng_state`` (``torch.get_rng_state()`` taken just before the
    failing step's forward, or ``{"cpu": ..., "cuda": [...]}``) makes every replay start from
    it, so dropout draws the failing step's masks; ``stats["replay_loss"]`` is the replayed
    loss, to check that the replay reproduced the step. Without ``rng_state``, a model with
    active dropout is replayed with dropout disabled as well: a finding there is the answer
    (it does not depend on the global RNG); ``stats["dropout"]`` says which mask ran and
    whether the answer is stable (one more set of replays).

    An fp16 overflow at a module is checked against its fix: the batch is replayed once more
    with that module kept in fp32 (twice when its backward still overflows), so the advice says
    when ``keep_fp32`` on it alone is not enough and what else is needed; an ``eps`` of that
    module below fp16's smallest subnormal is named (``stats["tiny_eps"]``,
    ``stats["keep_fp32_check"]``).

    ``optimizer`` (the one that trains ``model``): when the batch is finite and its weights are
    in bf16/fp16, one real step of it (its state restored afterwards) is judged too, phase
    ``"optimizer"``: ``eps_underflow`` or ``precision_stagnation`` (see
    :mod:`ampguard.forensics._optimizer`); it also names an underflowing eps behind weights that
    are already non-finite. ``ema`` (weights the optimizer does not own: an EMA / teacher
    module of ``model``, an :func:`~ampguard.watch_ema` object, or a list of them): one
    ``lerp_`` update at ``ema_decay`` is measured on copies too, and the EMA layers whose update
    rounds away are ``precision_stagnation`` as well (``stats["ema_layers"]``).

    Cost: two to five traced forward+backward passes (every op's output reduced on the
    device), a few host syncs, and one copy of the parameters and buffers while it runs; with
    ``optimizer`` and bf16/fp16 weights, one more forward+backward and optimizer step.

    >>> diag = ag.locate(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), (x, y))
    >>> diag.kind, diag.phase, diag.module, diag.op
    ('fp16_overflow', 'forward', 'blocks.2.mlp.fc2', 'aten.addmm')
    >>> print(diag.explain())
    """
    policy, scale = _check_args(model, loss_fn, precision, scale)
    _optimizer.check_optimizer(optimizer)
    watches = _optimizer.check_ema(ema, model, ema_decay)
    keep = Preserved(model, _check_rng(rng_state))
    try:
        keep.reset()
        bad_params, bad_buffers = _nonfinite_state(model)
        if bad_params:
            return broken_state(bad_params + bad_buffers, policy.precision, scale, optimizer)
        diag = _locate(model, loss_fn, batch, policy, scale, keep)
        diag = _mask_checked(model, loss_fn, batch, policy, scale, keep, diag, rng_state)
        if diag.module == "" and diag.op and not diag.ok:  # the root's own code: what fed it
            diag.stats["root_parameters"] = [n for n, _ in model.named_parameters(recurse=False)]
        if bad_buffers:
            return with_poisoned_buffers(diag, bad_buffers)
        if diag.ok and (optimizer is not None or watches):  # a benign probe too: batch is fine
            keep.reset()
            found = None
            if optimizer is not None:
                found = _optimizer.optimizer_step(model, loss_fn, batch, policy, optimizer)
            found = _optimizer.ema_step(watches, ema_decay, found)
            if found is not None:
                kind, module, stats = found
                op = "ema.lerp_" if stats.get("owner") == "ema" else "optimizer.step"
                return Diagnosis(kind, "optimizer", module, op, stats, policy.precision, scale)
        return diag
    finally:
        keep.close()


def _locate(
    model: torch.nn.Module,
    loss_fn: Callable,
    batch: Any,
    policy: Any,
    scale: float,
    keep: Preserved,
) -> Diagnosis:
    """The replays of :func:`locate` (forward and backward), from a reset state; every
    diagnosis carries the low-precision replay's loss (``stats["replay_loss"]``)."""
    fp32 = resolve_precision(FULL, policy.device_type)
    bad = nonfinite_leaves(batch)
    low = _low_replay(model, loss_fn, batch, policy, scale)
    if bad:
        return _replayed(input_nonfinite(low, bad, scale), low)
    keep.reset()
    ref = replay(model, loss_fn, batch, fp32, 1.0)
    if ref.failed:
        return _replayed(at_first_new(ref, "model_nonfinite", policy.precision, low), low)
    if low.failed:
        diag = _low_failed(model, loss_fn, batch, policy, keep, low, ref)
        return _replayed(_check_fix(model, loss_fn, batch, policy, keep, diag), low)
    found = silent(low, ref)
    if found is not None:
        return _replayed(found, low)
    errors = {m: round(v, 4) for m, v in grad_errors(low, ref).items()}
    stats = {"loss": low.loss, "loss_fp32": ref.loss, "grad_rel_error": errors}
    return _replayed(Diagnosis("none", None, None, None, stats, policy.precision, scale), low)


def _dropouts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The dropout modules that draw a mask in this forward (training mode, p > 0)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    ]


def _answer(d: Diagnosis) -> dict[str, Any]:
    return {"kind": d.kind, "code": d.code, "phase": d.phase, "module": d.module, "op": d.op}


def _mask_checked(
    model: torch.nn.Module,
    loss_fn: Callable,
    batch: Any,
    policy: Any,
    scale: float,
    keep: Preserved,
    diag: Diagnosis,
    rng_state: Any,
) -> Diagnosis:
    """Say which dropout mask the replays ran, and, without ``rng_state``, check the answer
    against the same batch with dropout disabled: a finding there does not depend on the
    global RNG, so it is the answer; a finding that needs the mask says so
    (``stats["dropout"]``: ``modules``, ``mask``, ``stable``, the other answer)."""
    drops = _dropouts(model)
    if not drops:
        return diag
    names = [n for n, _ in drops]
    if rng_state is not None:
        diag.stats["dropout"] = {"modules": names, "mask": "the failing step's (rng_state=)"}
        return diag
    keep.off = {id(m) for _, m in drops}
    try:
        keep.reset()
        off = _locate(model, loss_fn, batch, policy, scale, keep)
    finally:
        keep.off = set()
    stable = _answer(off) == _answer(diag)
    if not off.ok or stable:
        off.stats["dropout"] = {
            "modules": names,
            "mask": "none: dropout disabled in the probe (no global RNG draw)",
            "stable": stable,
            "with_global_rng_mask": _answer(diag),
        }
        return off
    diag.stats["dropout"] = {  # only a mask makes the batch fail: the answer depends on it
        "modules": names,
        "mask": "the global RNG's at the call (pass rng_state= for the failing step's)",
        "stable": False,
        "without_dropout": _answer(off),
    }
    return diag


def _low_replay(
    model: torch.nn.Module, loss_fn: Callable, batch: Any, policy: Any, scale: float
) -> Run:
    """The low-precision replay: under the policy's autocast, with the Linear layers emulated
    in the precision's format for fp8 / MXFP8 / NVFP4 / block-wise fp8."""
    with emulating(model, policy.precision) as layers:
        run = replay(model, loss_fn, batch, policy, scale)
    run.emulated = layers
    return run


def _replayed(diag: Diagnosis, low: Run) -> Diagnosis:
    diag.stats.setdefault("replay_loss", low.loss)  # the low-precision replay's loss
    fmt = emulated_format(low.precision)
    if fmt is not None:  # which layers computed in which format
        diag.stats.setdefault("emulated", {"format": fmt, "layers": list(low.emulated)})
    return diag


def _check_rng(value: Any) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict) and isinstance(value.get("cpu"), torch.Tensor):
        return value
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
        return {"cpu": value}
    raise TypeError(
        "rng_state must be torch.get_rng_state() or a dict {'cpu': ..., 'cuda': [...]}, got "
        f"{type(value).__name__}"
    )


# ---------------------------------------------------------------------- argument checks
def _check_args(model: Any, loss_fn: Any, precision: Any, scale: Any) -> tuple[Any, float]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}"
        )
    allowed = REPLAYABLE
    if precision not in allowed:
        raise ValueError(
            f"precision must be one of {allowed} (locate compares it with fp32), got {precision!r}"
        )
    policy = resolve_precision(precision, device_of(model.parameters()))
    if scale is None:
        scale = 2.0**16 if policy.needs_scaler else 1.0
    check_finite("scale", scale, positive=True, optional=True)  # None was replaced above
    return policy, float(scale)


def _nonfinite_state(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Names of the non-finite floating parameters and buffers. Cost: one sync per tensor."""

    def bad(named: Any) -> list[str]:
        return [
            n for n, t in named if t.is_floating_point() and t.numel() and not _finite(t.detach())
        ]

    return bad(model.named_parameters()), bad(model.named_buffers())


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _low_failed(
    model: torch.nn.Module,
    loss_fn: Callable,
    batch: Any,
    policy: Any,
    keep: Preserved,
    low: Run,
    ref: Run,
) -> Diagnosis:
    """Low precision failed, fp32 did not: an fp16 problem, or only the scaler probing."""
    name = policy.precision
    e = first_new(low)
    diag = classify_low(low, ref, e, name)
    if e is None or e.phase == "forward" or low.scale <= 1.0:
        return diag
    keep.reset()
    at_one = _low_replay(model, loss_fn, batch, policy, 1.0)
    if at_one.failed:  # real: no loss scale helps; say where it breaks at scale 1 as well
        e1 = first_new(at_one)
        if e1 is not None:
            diag.stats["at_scale_1"] = {"module": e1.module, "op": e1.op}
        return diag
    peak = max(
        (
            r[1]
            for ev, r in rows(at_one)
            if ev.phase == "backward" and ev.out_dtype in LOW_DTYPES and math.isfinite(r[1])
        ),
        default=0.0,
    )
    safe = 2.0 ** math.floor(math.log2(MAX[name] / peak)) if peak > 0 else None
    probe = {"module": e.module, "op": e.op, "scale": low.scale, "max_safe_scale": safe}
    real = _behind_probe(model, loss_fn, batch, policy, keep, ref, at_one, safe)
    if real is not None:  # a benign probe never hides a real finding of the same batch
        real.stats["scaler_probe"] = probe
        return real
    return Diagnosis(
        "none",
        e.phase,
        e.module,
        e.op,
        {**diag.stats, "max_safe_scale": safe},
        name,
        low.scale,
        benign=True,
    )


def _behind_probe(
    model: torch.nn.Module,
    loss_fn: Callable,
    batch: Any,
    policy: Any,
    keep: Preserved,
    ref: Run,
    at_one: Run,
    safe: float | None,
) -> Diagnosis | None:
    """What the batch gets wrong once the scaler backed off its probe: the silent checks
    (absorbed forward overflow, dead or underflowing layers) on a replay at the largest safe
    scale, where the scaler settles (at scale 1 when that replay overflows again)."""
    run = at_one
    if safe is not None and safe > 1.0:
        keep.reset()
        at_safe = replay(model, loss_fn, batch, policy, safe)
        run = at_one if at_safe.failed else at_safe
    return silent(run, ref)


def _check_fix(
    model: torch.nn.Module,
    loss_fn: Callable,
    batch: Any,
    policy: Any,
    keep: Preserved,
    diag: Diagnosis,
) -> Diagnosis:
    """An fp16 overflow at a module: check that keeping it in fp32 fixes the batch, and name an
    eps fp16 cannot hold (:mod:`ampguard.forensics._fixcheck`), so the advice is one that works."""
    if diag.kind != "fp16_overflow" or diag.benign or not diag.module:
        return diag
    diag.stats["tiny_eps"] = tiny_eps(model, diag.module, diag.precision)
    with emulating(model, policy.precision):  # the check replays in the same format
        diag.stats["keep_fp32_check"] = check_keep_fp32(
            model, loss_fn, batch, policy, diag.scale, keep, diag.module, first_new
        )
    return diag
