"""Forensics: which module and op produced the first non-finite value, in which pass, and why.

:func:`locate` replays one batch like a training step (forward under autocast, backward of
``loss * scale``) with every aten op traced, once in the requested low precision and once in
fp32, and compares them:

========================  =====  ==============================================================
kind                      code   meaning
========================  =====  ==============================================================
``"none"``                AG300  loss and gradients are finite, nothing flushed to zero
``"fp16_overflow"``       AG301  non-finite only in low precision (beyond its range), fp32 fine
``"fp16_underflow"``      AG302  a layer's gradients are all zero in low precision, not in fp32
``"model_nonfinite"``     AG303  fp32 goes non-finite too: not an AMP problem
``"input_nonfinite"``     AG304  the batch itself holds NaN/inf
``"none"`` (benign)       AG305  a backward overflow that vanishes at loss scale 1: the scaler
                                 probing its level; GradScaler skips the step and halves the
                                 scale, nothing to fix
``"precision_stagnation"``  AG365  ``optimizer=``: one optimizer step left most of a bf16/fp16
                                 layer's intended updates rounded away (phase "optimizer")
``"eps_underflow"``       AG366  ``optimizer=``: its eps rounds to 0 in the fp16/bf16 weights'
                                 dtype, so Adam writes inf/NaN (phase "optimizer")
========================  =====  ==============================================================

Non-finite *state*: non-finite parameters can only have been written by an optimizer step, so
they are ``model_nonfinite`` in phase ``"optimizer"`` (``eps_underflow`` when ``optimizer=``'s eps
underflows their dtype). Non-finite *buffers* with finite parameters (a BatchNorm whose fp16
forward overflowed and whose step was skipped without restoring them) do not stop the replay:
a train-mode forward reads the batch's statistics, not the running ones. When this batch's low
precision forward overflows and fp32 does not, the diagnosis is the overflow (an AMP problem,
``stats["poisoned_buffers"]``: this forward poisoned them); when the batch replays clean, the state
was broken before the step (``model_nonfinite``, ``stats["broken_before_step"]``).

``module`` follows :mod:`ampguard.forensics._optrace`: in forward, the innermost module whose own
code ran
the op; in backward, the module whose forward created the autograd node that produced the value
(a gradient cast down to an fp16 activation belongs to the module that produced the activation).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard._util.checks import check_finite
from ampguard.core.policy import device_of, resolve_precision
from ampguard.findings import Finding, make
from ampguard.forensics import _optimizer
from ampguard.forensics._fixcheck import check_keep_fp32, tiny_eps
from ampguard.forensics._optrace import OpEvent, is_new
from ampguard.forensics._replay import Preserved, Run, nonfinite_leaves, replay
from ampguard.forensics._silent import absorbed_overflow, partial_underflow
from ampguard.forensics._text import explain, fix_for, title_for

__all__ = ["Diagnosis", "locate", "KINDS", "CODES"]

KINDS = (
    "fp16_overflow",
    "fp16_underflow",
    "fp16_overflow_absorbed",
    "model_nonfinite",
    "input_nonfinite",
    "none",
    *_optimizer.KINDS,
)
CODES = {
    "none": "AG300",
    "fp16_overflow": "AG301",
    "fp16_underflow": "AG302",
    "fp16_overflow_absorbed": "AG360",
    "model_nonfinite": "AG303",
    "input_nonfinite": "AG304",
    "probe": "AG305",
    "precision_stagnation": "AG365",
    "eps_underflow": "AG366",
}
_TINY = {"fp16": torch.finfo(torch.float16).tiny, "bf16": torch.finfo(torch.bfloat16).tiny}
_MAX = {"fp16": torch.finfo(torch.float16).max, "bf16": torch.finfo(torch.bfloat16).max}
_LOW_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Diagnosis:
    """Where and why a batch goes non-finite (or flushes to zero) in mixed precision.

    ``kind`` is one of :data:`KINDS`; ``phase`` "forward" | "backward" | "optimizer" | None;
    ``module`` a name from ``model.named_modules()`` (``""`` the root) or None outside the model;
    ``op`` an aten op such as ``"aten.addmm"``; ``stats`` the evidence (max |x| in low precision
    and fp32 at that point, NaN/inf counts, dtype, shape, loss scale); ``benign`` marks a
    loss-scale probe.
    """

    kind: str
    phase: str | None
    module: str | None
    op: str | None
    stats: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp16"
    scale: float = 1.0
    benign: bool = False

    @property
    def code(self) -> str:
        """The AG3xx finding code (AG300-AG305, AG360, AG365, AG366)."""
        return CODES["probe"] if self.benign else CODES[self.kind]

    @property
    def ok(self) -> bool:
        """True when there is nothing to fix (kind "none", benign probes included)."""
        return self.kind == "none"

    def explain(self) -> str:
        """A few sentences: what happened, where, the evidence, and the fix."""
        return explain(self)

    def to_finding(self, step: int | None = None) -> Finding:
        """This diagnosis as a :class:`~ampguard.findings.Finding`.

        The message is :meth:`explain` without its closing "Fix: ...", which is the ``fix``
        field (reports print both, so it would otherwise appear twice).
        """
        fix = fix_for(self)
        message = self.explain().removesuffix(f" Fix: {fix}")
        return make(
            self.code, message, title=title_for(self), step=step, evidence=self.to_dict(), fix=fix
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; :meth:`from_dict` inverts it."""
        return {
            "kind": self.kind,
            "phase": self.phase,
            "module": self.module,
            "op": self.op,
            "stats": _json_safe(self.stats),
            "precision": self.precision,
            "scale": self.scale,
            "benign": self.benign,
            "code": self.code,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Diagnosis:
        """Inverse of :meth:`to_dict` (``"nan"``/``"inf"`` strings become floats again)."""
        keys = ("kind", "phase", "module", "op", "precision", "scale", "benign")
        return cls(
            **{k: data[k] for k in keys if k in data}, stats=_json_restore(data.get("stats", {}))
        )

    def __str__(self) -> str:
        if self.module is None and self.op is None:
            return f"{self.code} {self.kind}"
        where = f"{self.module!r}" if self.module is not None else "outside the model"
        return f"{self.code} {self.kind} ({self.phase or '-'}) at {where} {self.op or ''}".rstrip()


def locate(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    precision: str = "fp16",
    scale: float | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    rng_state: dict[str, Any] | torch.Tensor | None = None,
) -> Diagnosis:
    """Find the module and op where ``batch`` first goes non-finite, and classify why.

    ``loss_fn(model, batch)`` returns the scalar loss. The batch runs like a training step in
    ``precision`` ("fp16" | "bf16" | "auto") with the backward of ``loss * scale`` (default
    ``2**16`` under fp16, as ``torch.amp.GradScaler`` starts; 1 under bf16), then in fp32, and,
    for a backward overflow, once more at scale 1 to tell a scaler probe from a real overflow.
    Parameters, buffers, gradients, RNG state and training modes are restored afterwards and
    no hook is left behind. ``rng_state`` (``torch.get_rng_state()`` taken just before the
    failing step's forward, or ``{"cpu": ..., "cuda": [...]}``) makes every replay start from
    it, so dropout draws the failing step's masks; ``stats["replay_loss"]`` is the replayed
    loss, to check that the replay reproduced the step.

    An fp16 overflow at a module is checked against its fix: the batch is replayed once more
    with that module kept in fp32 (twice when its backward still overflows), so the advice says
    when ``keep_fp32`` on it alone is not enough and what else is needed; an ``eps`` of that
    module below fp16's smallest subnormal is named (``stats["tiny_eps"]``,
    ``stats["keep_fp32_check"]``).

    ``optimizer`` (the one that trains ``model``): when the batch is finite and its weights are
    in bf16/fp16, one real step of it (its state restored afterwards) is judged too, phase
    ``"optimizer"``: ``eps_underflow`` or ``precision_stagnation`` (see
    :mod:`ampguard.forensics._optimizer`); it also names an underflowing eps behind weights that
    are already non-finite.

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
    keep = Preserved(model, _check_rng(rng_state))
    try:
        keep.reset()
        bad_params, bad_buffers = _nonfinite_state(model)
        if bad_params:
            return _broken_state(bad_params + bad_buffers, policy.precision, scale, optimizer)
        diag = _locate(model, loss_fn, batch, policy, scale, keep)
        if bad_buffers:
            return _with_poisoned_buffers(diag, bad_buffers)
        if diag.ok and optimizer is not None:  # a benign probe too: the batch itself is fine
            keep.reset()
            found = _optimizer.optimizer_step(model, loss_fn, batch, policy, optimizer)
            if found is not None:
                kind, module, stats = found
                return Diagnosis(
                    kind, "optimizer", module, "optimizer.step", stats, policy.precision, scale
                )
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
    fp32 = resolve_precision("fp32", policy.device_type)
    bad = nonfinite_leaves(batch)
    low = replay(model, loss_fn, batch, policy, scale)
    if bad:
        return _replayed(_input_nonfinite(low, bad, scale), low)
    keep.reset()
    ref = replay(model, loss_fn, batch, fp32, 1.0)
    if ref.failed:
        return _replayed(_at(ref, "model_nonfinite", policy.precision, low), low)
    if low.failed:
        diag = _low_failed(model, loss_fn, batch, policy, keep, low, ref)
        return _replayed(_check_fix(model, loss_fn, batch, policy, keep, diag), low)
    none = Diagnosis(
        "none",
        None,
        None,
        None,
        {"loss": low.loss, "loss_fp32": ref.loss},
        policy.precision,
        scale,
    )
    return _replayed(_silent(low, ref) or none, low)


def _replayed(diag: Diagnosis, low: Run) -> Diagnosis:
    diag.stats.setdefault("replay_loss", low.loss)  # the low-precision replay's loss
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


def _json_safe(value: Any) -> Any:
    """Non-finite floats as "nan"/"inf"/"-inf" strings, recursively (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _json_restore(value: Any) -> Any:
    if value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, dict):
        return {k: _json_restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_restore(v) for v in value]
    return value


# ---------------------------------------------------------------------- argument checks
def _check_args(model: Any, loss_fn: Any, precision: Any, scale: Any) -> tuple[Any, float]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}"
        )
    allowed = ("fp16", "bf16", "auto")
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


# ---------------------------------------------------------------------- classification
def _is_new(run: Run, e: OpEvent) -> bool:
    return is_new(run.row(e), e.intentional)


def _first_new(run: Run) -> OpEvent | None:
    """The first op that made a non-finite value; forward ops count only if the loss is bad."""
    phases = ("forward", "backward") if not math.isfinite(run.loss) else ("backward",)
    for phase in phases:
        for e in run.events:
            if e.phase == phase and _is_new(run, e):
                return e
    return next((e for e, r in _rows(run) if not math.isfinite(r[1])), None)


def _keys(run: Run) -> dict[tuple, int]:
    """(phase, module, op, occurrence) -> event index: aligns ops of two runs of one batch."""
    seen: Counter = Counter()
    out = {}
    for e in run.events:
        k = (e.phase, e.module, e.op)
        out[k + (seen[k],)] = e.index
        seen[k] += 1
    return out


def _counterpart(run: Run, e: OpEvent, other: Run) -> list[float] | None:
    seen = sum(
        1 for x in run.events[: e.index] if (x.phase, x.module, x.op) == (e.phase, e.module, e.op)
    )
    i = _keys(other).get((e.phase, e.module, e.op, seen))
    return None if i is None else other.row(other.events[i])


def _event_stats(run: Run, e: OpEvent, other: Run | None, low_name: str) -> dict[str, Any]:
    row = run.row(e) or [-1.0] * 5
    measured = row[3] >= 0  # counts exist for the first non-finite op of each pass
    stats: dict[str, Any] = {
        "dtype": str(e.out_dtype).replace("torch.", "") if e.out_dtype else None,
        "shape": list(e.shape),
        "nan_count": int(row[3]) if measured else None,
        "inf_count": int(row[4]) if measured else None,
        "scale": run.scale,
        "limit": _MAX.get(low_name),
    }
    key = "fp32" if run.precision == "fp32" else low_name
    numel = math.prod(e.shape)
    all_bad = measured and numel and row[3] + row[4] >= numel
    stats[f"max_abs_{key}"] = row[2] if measured and not all_bad else None
    stats[f"input_max_abs_{key}"] = row[0]
    if other is not None:
        twin = _counterpart(run, e, other)
        okey = "fp32" if other.precision == "fp32" else low_name
        # backward values grow with the loss scale: state the other run's in this run's units
        factor = run.scale / other.scale if e.phase == "backward" else 1.0
        stats[f"max_abs_{okey}"] = None if twin is None or twin[1] < 0 else twin[1] * factor
        stats[f"input_max_abs_{okey}"] = None if twin is None or twin[0] < 0 else twin[0] * factor
    return stats


def _at(run: Run, kind: str, low: str, other: Run | None = None, benign: bool = False) -> Diagnosis:
    e = _first_new(run)
    if e is None:
        return Diagnosis(kind, None, None, None, {"loss": run.loss}, low, run.scale, benign)
    return Diagnosis(
        kind, e.phase, e.module, e.op, _event_stats(run, e, other, low), low, run.scale, benign
    )


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
    e = _first_new(low)
    diag = _classify_low(low, ref, e, name)
    if e is None or e.phase == "forward" or low.scale <= 1.0:
        return diag
    keep.reset()
    at_one = replay(model, loss_fn, batch, policy, 1.0)
    if at_one.failed:  # real: no loss scale helps; say where it breaks at scale 1 as well
        e1 = _first_new(at_one)
        if e1 is not None:
            diag.stats["at_scale_1"] = {"module": e1.module, "op": e1.op}
        return diag
    peak = max(
        (
            r[1]
            for ev, r in _rows(at_one)
            if ev.phase == "backward" and ev.out_dtype in _LOW_DTYPES and math.isfinite(r[1])
        ),
        default=0.0,
    )
    safe = 2.0 ** math.floor(math.log2(_MAX[name] / peak)) if peak > 0 else None
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
    diag.stats["keep_fp32_check"] = check_keep_fp32(
        model, loss_fn, batch, policy, diag.scale, keep, diag.module, _first_new
    )
    return diag


def _classify_low(run: Run, ref: Run, e: OpEvent | None, name: str) -> Diagnosis:
    if e is None:
        return Diagnosis("fp16_overflow", None, None, None, {"loss": run.loss}, name, run.scale)
    stats = _event_stats(run, e, ref, name)
    kind = "fp16_overflow"
    twin = _counterpart(run, e, ref)
    if twin is not None and 0 <= twin[1] <= _MAX[name] and 0 <= twin[0] < _TINY[name]:
        kind = "fp16_underflow"  # e.g. log or 1/x of a value that flushed to zero
    return Diagnosis(kind, e.phase, e.module, e.op, stats, name, run.scale)


def _rows(run: Run) -> list[tuple[OpEvent, list[float]]]:
    return [(e, run.stats[e.row]) for e in run.events if e.row is not None]


def _underflow(low: Run, ref: Run) -> Diagnosis | None:
    dead = [n for n in low.order if low.grads.get(n) == 0.0 and ref.grads.get(n, 0.0) > 0.0]
    if not dead:
        return None
    module = dead[0].rpartition(".")[0]
    flush = next(
        (
            e
            for e, r in _rows(low)
            if e.phase == "backward"
            and r[1] == 0.0
            and r[0] > 0.0
            and _flushed_only_here(low, e, ref)
        ),
        None,
    )
    stats = {
        "dead_parameters": dead,
        "grad_max_abs_fp32": ref.grads[dead[0]],
        "grad_max_abs_" + low.precision: 0.0,
        "scale": low.scale,
        "flushed_by": None if flush is None else {"module": flush.module, "op": flush.op},
    }
    return Diagnosis(
        "fp16_underflow",
        "backward",
        module,
        None if flush is None else flush.op,
        stats,
        low.precision,
        low.scale,
    )


def _silent(low: Run, ref: Run) -> Diagnosis | None:
    """Loss and gradients finite: an absorbed forward overflow, a dead layer, or a layer that
    loses a large share of its gradient elements (see :mod:`ampguard.forensics._silent`)."""
    absorbed = absorbed_overflow(low, ref, _counterpart)
    if absorbed is not None:
        e, consumer = absorbed["event"], absorbed["consumer"]
        stats = _event_stats(low, e, ref, low.precision)
        stats["absorbed_by"] = (
            None if consumer is None else {"module": consumer.module, "op": consumer.op}
        )
        stats["loss"], stats["loss_fp32"] = low.loss, ref.loss
        return Diagnosis(
            "fp16_overflow_absorbed", "forward", e.module, e.op, stats, low.precision, low.scale
        )
    dead = _underflow(low, ref)
    if dead is not None:
        return dead
    partial = partial_underflow(low, ref)
    if partial is None:
        return None
    stats = {
        "underflow_share": partial["share"],
        "layers": partial["layers"],
        "flushed": partial["flushed"],
        "lossy_subnormal": partial["lossy"],
        "nonzero_fp32": partial["nonzero_fp32"],
        "threshold": partial["threshold"],
        "lossy_bits": partial["lossy_bits"],
        "scale": low.scale,
    }
    return Diagnosis(
        "fp16_underflow", "backward", partial["module"], None, stats, low.precision, low.scale
    )


def _flushed_only_here(low: Run, e: OpEvent, ref: Run) -> bool:
    twin = _counterpart(low, e, ref)
    return twin is None or twin[1] > 0.0


def _input_nonfinite(low: Run, bad: list[dict[str, Any]], scale: float) -> Diagnosis:
    bad_in = [e for e, r in _rows(low) if e.phase == "forward" and not math.isfinite(r[0])]
    first = next((e for e in bad_in if e.module is not None), bad_in[0] if bad_in else None)
    stats = {
        "inputs": bad,
        "nan_count": sum(b["nan"] for b in bad),
        "inf_count": sum(b["inf"] for b in bad),
    }
    if first is None:
        return Diagnosis("input_nonfinite", "forward", None, None, stats, low.precision, scale)
    return Diagnosis(
        "input_nonfinite", "forward", first.module, first.op, stats, low.precision, scale
    )


def _broken_state(
    bad: list[str], precision: str, scale: float, optimizer: torch.optim.Optimizer | None
) -> Diagnosis:
    """Non-finite parameters before any run: only an optimizer step writes parameters."""
    stats: dict[str, Any] = {"nonfinite_tensors": bad}
    eps = _optimizer.eps_underflows(optimizer) if optimizer is not None else []
    module = bad[0].rpartition(".")[0]
    if eps:
        stats["eps_underflow"] = eps
        return Diagnosis(
            "eps_underflow", "optimizer", module, "optimizer.step", stats, precision, scale
        )
    return Diagnosis("model_nonfinite", "optimizer", module, None, stats, precision, scale)


def _with_poisoned_buffers(diag: Diagnosis, bad: list[str]) -> Diagnosis:
    """Finite parameters, non-finite buffers: poisoned by this batch's low-precision forward
    (an AMP problem: the overflow diagnosis stands), or broken before this step."""
    if diag.kind in ("fp16_overflow", "fp16_underflow") and diag.phase == "forward":
        return Diagnosis(
            diag.kind,
            diag.phase,
            diag.module,
            diag.op,
            {**diag.stats, "poisoned_buffers": bad},
            diag.precision,
            diag.scale,
        )
    return Diagnosis(
        "model_nonfinite",
        None,
        bad[0].rpartition(".")[0],
        None,
        {"nonfinite_tensors": bad, "broken_before_step": True, "replay": diag.kind},
        diag.precision,
        diag.scale,
    )
