"""The advisor probes the loss code too: fp16 ops outside every module (AG363).

A loss function that computes on the model's fp16 outputs without ``.float()`` first (a
``torch.exp(out)``, ``out.log()``, ``out ** 2`` in the loss) runs those ops in fp16 even with
autocast off, and ``keep_fp32`` cannot reach them: they belong to no module. The op-level fp16
forward of :mod:`ampguard.experiments._inner_probe` hands every low-precision op that runs
outside every module to :class:`LossOps`, which keeps the first :data:`MAX_OPS` with the source
line that ran them (:func:`ampguard.forensics.user_line`, as ``ag.locate`` records
``stats["source"]``). :func:`loss_finding` then names the first that overflows (inf/NaN from
finite inputs) or flushes at least :data:`FLUSH_SHARE` of its nonzero fp32 values to zero, with
the fix that applies there: compute it in fp32, or rescale before it.

Cost: per recorded op, the device reductions the inner probe makes; at the end one fp32 rerun
of each recorded op (loss-sized tensors) and one host sync.
"""

from __future__ import annotations

from typing import Any

import torch

from ampguard.findings import Finding, make
from ampguard.forensics import flatten_tensors, user_line

__all__ = ["LossOps", "loss_finding", "MAX_OPS", "FLUSH_SHARE"]

MAX_OPS = 64  # loss-code ops kept per probe
FLUSH_SHARE = 0.25  # share of nonzero fp32 values that fp16 flushes to zero, for a finding
_LOW = (torch.float16, torch.bfloat16)


class LossOps:
    """fp16/bf16 ops run outside every module: (op, func, args, kwargs, output, new non-finite,
    source line)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, Any, Any, Any, torch.Tensor, torch.Tensor, str | None]] = []

    def record(
        self, name: str, func: Any, args: Any, kwargs: Any, out: torch.Tensor, new: torch.Tensor
    ) -> None:
        if len(self.ops) < MAX_OPS:
            self.ops.append((name, func, args, kwargs, out, new, user_line()))


def _up(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.float() if v.dtype in _LOW else v
    if isinstance(v, (list, tuple)):
        return type(v)(_up(x) for x in v)
    return v


def _fp32(func: Any, args: Any, kwargs: Any) -> torch.Tensor | None:
    """The op recomputed from fp32 copies of its inputs (None if it refuses)."""
    try:
        with torch.no_grad():
            out = func(*_up(args), **_up(kwargs))
    except Exception:  # noqa: BLE001 - the fp32 value is optional evidence
        return None
    return next((t for t in flatten_tensors(out) if t.is_floating_point()), None)


def loss_finding(loss: LossOps) -> Finding | None:
    """AG363 for the first loss-code op that overflows or underflows in fp16, or None.
    Cost: one fp32 rerun per recorded op and one host sync."""
    rows = []
    for _, func, args, kwargs, out, new, _ in loss.ops:
        ref = _fp32(func, args, kwargs)
        if ref is None or ref.shape != out.shape:
            zero = torch.zeros((), device=new.device)
            rows.append(torch.stack([new.float(), zero, zero, zero]))
            continue
        nonzero = (ref != 0) & torch.isfinite(ref)
        flushed = nonzero & (out == 0)
        amax = torch.where(torch.isfinite(ref), ref.abs(), 0.0).amax()
        rows.append(
            torch.stack([new.float(), flushed.sum().float(), nonzero.sum().float(), amax.float()])
        )
    if not rows:
        return None
    values = torch.stack(rows).tolist()
    for (name, _, _, _, out, _, source), (bad, flushed, nonzero, amax) in zip(
        loss.ops, values, strict=True
    ):
        dtype = str(out.dtype).removeprefix("torch.").replace("float16", "fp16")
        dtype = dtype.replace("bfloat16", "bf16")
        at = source or "loss_fn"
        if bad:
            what = f"overflows {dtype} (inf/NaN from finite inputs; it reaches {amax:.4g} in fp32)"
            kind = "overflow"
        elif nonzero and flushed / nonzero >= FLUSH_SHARE:
            what = (
                f"flushes {flushed / nonzero:.0%} of its nonzero values to zero in {dtype} "
                "(fp32 keeps them)"
            )
            kind = "underflow"
        else:
            continue
        rescale = (
            "subtract the max before an exp, use torch.logsumexp / F.log_softmax"
            if kind == "overflow"
            else "scale the values up before it, or work in log space"
        )
        return make(
            "AG363",
            f"In the loss code at {at}, {name} on {dtype} values {what}. It runs outside every "
            "module (on the model's low-precision output), so keep_fp32 cannot reach it.",
            detail=f"{name} at {at}",
            evidence={
                "op": name,
                "source": source,
                "kind": kind,
                "dtype": dtype,
                "max_abs_fp32": amax,
                "flushed": int(flushed),
                "nonzero": int(nonzero),
            },
            fix=f"Compute it in fp32 there: cast its inputs with .float() first (or wrap it in "
            f"torch.autocast(device_type, enabled=False)); or rescale before it ({rescale}); or "
            "train in bf16 (precision='bf16').",
        )
    return None
