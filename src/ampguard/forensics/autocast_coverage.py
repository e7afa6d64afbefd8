"""Autocast coverage: what really ran in fp16/bf16 and what escaped, per module, for one step.

Public as ``ampguard.coverage`` / ``ampguard.Coverage``. The module is named differently from the
function so that importing it never puts a module object where ``ampguard.coverage`` is expected.

:func:`coverage` traces one forward and backward of a batch (every aten op, with the module
that ran it, see :mod:`ampguard.forensics._optrace`) and counts, per module (its own ops and its
children's), the ops and the FLOP-heavy ops (matmul / conv / attention family) that computed in
each precision. Two findings come out of it:

- **AG310 module escaped autocast**: a module whose FLOP-heavy work ran entirely in fp32 while
  autocast was on: called under ``autocast(enabled=False)`` (a sub-model, a target network),
  an internal ``.float()`` island, or a backward that left autocast (a custom
  ``autograd.Function`` without ``torch.amp.custom_fwd``/``custom_bwd``). Only the outermost
  such module is named; modules kept in fp32 on purpose (``keep_fp32``) are not findings.
- **AG311 fragile op in fp16**: a range-sensitive op ran in the forward pass with low-precision
  inputs: exp/log/pow and friends, softmax/log_softmax, or a reduction (sum, prod, cumsum,
  var, std, vector norm, logsumexp) over at least ``large_reduction`` elements. Layer, group and
  batch norm are not listed: their kernels accumulate in fp32 whatever the input dtype.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard import precisions
from ampguard._util.checks import check_int
from ampguard.core.policy import device_of, dtype_of, resolve_precision
from ampguard.findings import Finding, make
from ampguard.forensics._optrace import OpEvent
from ampguard.forensics._replay import Preserved, replay
from ampguard.forensics.islands import match_modules

__all__ = ["Coverage", "coverage", "coverage_from_events", "is_heavy", "FRAGILE_OPS"]

_HEAVY = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "convolution",
    "_convolution",
    "convolution_backward",
    "conv1d",
    "conv2d",
    "conv3d",
    "addmv",
    "mv",
    "_scaled_mm",
    "_int_mm",
    "cudnn_convolution",
    "mkldnn_convolution",
}
FRAGILE_OPS = {
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "pow",
    "reciprocal",
    "rsqrt",
    "sinh",
    "cosh",
    "erfinv",
    "_softmax",
    "softmax",
    "_log_softmax",
    "log_softmax",
}
_REDUCTIONS = {
    "sum",
    "prod",
    "cumsum",
    "cumprod",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "linalg_vector_norm",
    "norm",
    "logsumexp",
}
_LABELS = {  # what an op ran in, by its output dtype (the registry's short names)
    d: precisions.label(str(d).removeprefix("torch."))
    for d in (torch.float16, torch.bfloat16, torch.float32)
} | {torch.float64: "fp64"}


def _low_labels() -> tuple[str, ...]:
    """The labels of the registry's low dtypes (``("fp16", "bf16")``): heavy ops in these ran in
    low precision."""
    lows = (dtype_of(p.low_dtype) for p in precisions.REGISTRY.values())
    return tuple(dict.fromkeys(_LABELS[d] for d in lows if d in _LABELS))


_LOW = _low_labels()


def is_heavy(op: str) -> bool:
    """Matmul / convolution / attention-family aten op (``"aten.addmm"``)."""
    name = op.rpartition(".")[2]
    return name in _HEAVY or "scaled_dot_product" in name or "attention" in name


def _label(dtype: torch.dtype | None) -> str:
    return _LABELS.get(dtype, "other") if dtype is not None else "other"


@dataclass(frozen=True)
class Coverage:
    """Per-module precision census of one training step.

    ``modules[name]`` (``""`` is the root) holds counts over the module's own ops and its
    children's: ``forward`` / ``backward`` (dtype label -> ops), ``heavy_forward`` /
    ``heavy_backward`` (the same for matmul/conv/attention ops), ``casts`` and ``autocast``
    (was autocast on whenever its forward started). ``outside`` is the same for code outside
    the model (``loss_fn``); ``ops`` counts each aten op per dtype; ``escaped`` and ``fragile``
    are the AG310 / AG311 evidence.
    """

    precision: str
    modules: dict[str, dict[str, Any]]
    outside: dict[str, Any]
    ops: dict[str, dict[str, int]]
    escaped: list[dict[str, Any]] = field(default_factory=list)
    fragile: list[dict[str, Any]] = field(default_factory=list)
    step: int | None = None

    @property
    def low_precision_share(self) -> float:
        """Fraction of FLOP-heavy ops (forward and backward) that ran in fp16/bf16."""
        heavy: Counter = Counter()
        for part in (self.modules.get("", {}), self.outside):
            for key in ("heavy_forward", "heavy_backward"):
                heavy.update(part.get(key, {}))
        total = sum(heavy.values())
        return sum(heavy[k] for k in _LOW) / total if total else 0.0

    def findings(self) -> list[Finding]:
        """AG310 per escaped module, AG311 per (module, fragile op)."""
        return [_escaped_finding(e, self.step) for e in self.escaped] + [
            _fragile_finding(f, self.step) for f in self.fragile
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; :meth:`from_dict` inverts it."""
        return {
            "precision": self.precision,
            "modules": self.modules,
            "outside": self.outside,
            "ops": self.ops,
            "escaped": self.escaped,
            "fragile": self.fragile,
            "step": self.step,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Coverage:
        return cls(
            **{
                k: data[k]
                for k in ("precision", "modules", "outside", "ops", "escaped", "fragile", "step")
                if k in data
            }
        )

    def summary(self, limit: int = 20) -> str:
        """A plain-text table: module, heavy ops per dtype (fwd / bwd), all ops per dtype."""
        rows = [
            f"autocast coverage ({self.precision}): "
            f"{self.low_precision_share:.0%} of matmul-family ops in low precision",
            f"{'module':<32} {'heavy fwd':<18} {'heavy bwd':<18} ops",
        ]
        for name, m in list(self.modules.items())[:limit]:
            rows.append(
                f"{(name or '(root)'):<32} {_fmt(m['heavy_forward']):<18} "
                f"{_fmt(m['heavy_backward']):<18} "
                f"{_fmt(Counter(m['forward']) + Counter(m['backward']))}"
            )
        rows += [str(f) for f in self.findings()]
        return "\n".join(rows)


def _fmt(counts: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"


def coverage(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    precision: str = "fp16",
    *,
    keep_fp32: Iterable[str] = (),
    large_reduction: int = 4096,
) -> Coverage:
    """Trace one forward+backward of ``batch`` under ``precision`` autocast and count, per
    module, what ran in which precision (see the module docstring for AG310/AG311).

    ``loss_fn(model, batch)`` returns the scalar loss. ``keep_fp32`` names modules (fnmatch
    patterns) that are in fp32 on purpose. Parameters, buffers, gradients, RNG state and
    training modes are restored afterwards.
    Cost: one traced forward+backward, two host syncs, a copy of parameters and buffers.

    >>> cov = ag.coverage(model, lambda m, b: F.mse_loss(m(b[0]), b[1]), (x, y))
    >>> [f.code for f in cov.findings()]
    ['AG310']
    """
    allowed = precisions.traced()
    if precision not in allowed:
        raise ValueError(f"precision must be one of {allowed}, got {precision!r}")
    check_int("large_reduction", large_reduction)
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}"
        )
    policy = resolve_precision(precision, device_of(model.parameters()))
    kept = match_modules(model, keep_fp32) if keep_fp32 else []
    keep = Preserved(model)
    try:
        keep.reset()
        run = replay(model, loss_fn, batch, policy, 1.0, numerics=False)
    finally:
        keep.close()
    return coverage_from_events(
        run.events, policy.precision, run.entered, kept=kept, large_reduction=large_reduction
    )


def coverage_from_events(
    events: list[OpEvent],
    precision: str,
    entered: dict[str, bool],
    *,
    kept: Iterable[str] = (),
    large_reduction: int = 4096,
    step: int | None = None,
) -> Coverage:
    """Build a :class:`Coverage` from traced events (``OpTrace.events``) of one step."""
    kept = tuple(kept)
    modules: dict[str, dict[str, Any]] = {name: _empty(entered[name]) for name in entered}
    free: dict[str, dict[str, Any]] = {}  # the same counts without ops of kept modules
    outside = _empty(None)
    ops: dict[str, Counter] = {}
    for e in events:
        label = "cast" if e.op == "aten._to_copy" else _label(e.dtype)
        ops.setdefault(e.op, Counter())[label] += 1
        if e.module is None:
            _count(outside, e, label)
            continue
        for n in _ancestors(e.module):
            _count(modules.setdefault(n, _empty(None)), e, label)
            if not _is_under(e.module, kept):
                _count(free.setdefault(n, _empty(modules[n]["autocast"])), e, label)
    entry = precisions.REGISTRY.get(precision)
    escaped = _escaped(free, kept) if entry is not None and not entry.is_full else []
    fragile = _fragile(events, large_reduction)
    return Coverage(
        precision, modules, outside, {k: dict(v) for k, v in ops.items()}, escaped, fragile, step
    )


def _empty(autocast: bool | None) -> dict[str, Any]:
    return {
        "forward": {},
        "backward": {},
        "heavy_forward": {},
        "heavy_backward": {},
        "casts": 0,
        "autocast": autocast,
    }


def _count(target: dict[str, Any], e: OpEvent, label: str) -> None:
    if label == "cast":
        target["casts"] += 1
        return
    counts = target[e.phase]
    counts[label] = counts.get(label, 0) + 1
    if is_heavy(e.op):
        heavy = target["heavy_" + e.phase]
        heavy[label] = heavy.get(label, 0) + 1


def _ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b.c", "a.b", "a", ""]``."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _is_under(name: str, roots: Iterable[str]) -> bool:
    return any(name == r or r == "" or name.startswith(r + ".") for r in roots)


def _escaped(modules: dict[str, dict[str, Any]], kept: tuple[str, ...]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for name, m in sorted(modules.items(), key=lambda kv: kv[0].count(".") if kv[0] else -1):
        if _is_under(name, kept) or _is_under(name, [f["module"] for f in found]):
            continue
        fwd, bwd = m["heavy_forward"], m["heavy_backward"]
        low_fwd = sum(fwd.get(k, 0) for k in _LOW)
        if fwd.get("fp32", 0) and not low_fwd:
            reason = "called_without_autocast" if m["autocast"] is False else "fp32_inside"
            found.append(
                {
                    "module": name,
                    "phase": "forward",
                    "reason": reason,
                    "heavy_fp32": fwd["fp32"] + bwd.get("fp32", 0),
                }
            )
        elif bwd.get("fp32", 0) and low_fwd and not any(bwd.get(k, 0) for k in _LOW):
            found.append(
                {
                    "module": name,
                    "phase": "backward",
                    "reason": "backward_in_fp32",
                    "heavy_fp32": bwd["fp32"],
                    "heavy_low_forward": low_fwd,
                }
            )
    return found


def _fragile(events: list[OpEvent], large_reduction: int) -> list[dict[str, Any]]:
    hits: dict[tuple[str | None, str], dict[str, Any]] = {}
    for e in events:
        name = e.op.rpartition(".")[2]
        if e.phase != "forward" or _label(e.dtype) not in _LOW:
            continue
        if name in FRAGILE_OPS or (name in _REDUCTIONS and e.numel >= large_reduction):
            hit = hits.setdefault(
                (e.module, e.op),
                {
                    "module": e.module,
                    "op": e.op,
                    "dtype": _label(e.dtype),
                    "count": 0,
                    "max_numel": 0,
                },
            )
            hit["count"] += 1
            hit["max_numel"] = max(hit["max_numel"], e.numel)
    return list(hits.values())


def _where(module: str | None) -> str:
    if module is None:
        return "code outside the model (loss_fn)"
    return "the root module ('')" if module == "" else repr(module)


_REASONS = {
    "called_without_autocast": "was called with autocast disabled (inside "
    "torch.autocast(enabled=False), or before the autocast block)",
    "fp32_inside": "disables autocast inside its forward (a manual .float() island)",
    "backward_in_fp32": "ran its forward in low precision but its backward in fp32: a custom "
    "torch.autograd.Function without torch.amp.custom_fwd/custom_bwd leaves autocast in "
    "backward",
}


# what ``heavy_fp32`` counts: a forward escape counts its backward ops too (see _escaped)
_COUNTED = {"forward": "forward and backward", "backward": "backward"}


def _escaped_finding(e: dict[str, Any], step: int | None) -> Finding:
    fix = (
        "Decorate the Function's forward with @torch.amp.custom_fwd(device_type=...) and its "
        "backward with @torch.amp.custom_bwd(device_type=...)."
        if e["reason"] == "backward_in_fp32"
        else "Call it inside the autocast block (e.g. with guard.autocast():) so its matmuls run "
        "in low precision; if fp32 is intended, declare it with keep_fp32=[...]."
    )
    return make(
        "AG310",
        f"{_where(e['module'])} ran all {e['heavy_fp32']} of its {_COUNTED[e['phase']]} "
        f"matmul-family ops in fp32: it {_REASONS[e['reason']]}.",
        detail=_where(e["module"]),
        step=step,
        evidence=dict(e),
        fix=fix,
    )


def _fragile_finding(f: dict[str, Any], step: int | None) -> Finding:
    return make(
        "AG311",
        f"{f['op']} ran {f['count']} time(s) in {f['dtype']} in the forward pass of "
        f"{_where(f['module'])} (up to {f['max_numel']} elements per input); its result can "
        f"overflow or lose range in {f['dtype']}.",
        detail=f"{f['op']} in {_where(f['module'])} ({f['dtype']})",
        step=step,
        evidence=dict(f),
        fix=(
            f"Compute it in fp32: x.float() before {f['op'].rpartition('.')[2]} inside "
            f"torch.autocast(enabled=False), or keep_fp32=[{f['module']!r}]; or use bf16."
        ),
    )
