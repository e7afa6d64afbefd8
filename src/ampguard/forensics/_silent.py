"""Silent failures in a replayed step: the loss and the gradients are finite, the step is not fine.

Two checks over a low-precision :class:`~ampguard.forensics._replay.Run` and its fp32 twin, used
by :func:`ampguard.locate` once both runs came out finite:

- :func:`absorbed_overflow`: an fp16 op of the forward made inf (or NaN) from finite inputs, and
  a later op turned it back into finite values before the loss (a hand-written norm:
  ``(x - u).pow(2)`` -> inf, ``mean`` -> inf, ``(x - u) / sqrt(inf)`` = 0: the layer outputs its
  bias and training goes on at chance). fp32 must stay in range at the same op, else it is no
  precision problem.
- :func:`partial_underflow`: per layer, the share of its nonzero fp32 gradient elements that the
  low-precision step flushed to zero or left as a subnormal with at most :data:`LOSSY_BITS`
  significant bits, at the loss scale of the run (``locate(..., scale=1.0)`` for a loop without
  a scaler). Above :data:`UNDERFLOW_SHARE` it is ``fp16_underflow`` for that layer.

Both return the fields of a Diagnosis (``kind, phase, module, op, stats``) or None; building the
Diagnosis stays with the caller.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampguard import precisions
from ampguard.core.policy import dtype_of
from ampguard.forensics._optrace import OpEvent, is_new
from ampguard.forensics._replay import Run

__all__ = [
    "UNDERFLOW_SHARE",
    "LOSSY_BITS",
    "REL_ERROR",
    "absorbed_overflow",
    "grad_errors",
    "partial_underflow",
]

UNDERFLOW_SHARE = 0.10  # a layer losing more than this share of its gradient elements fires
LOSSY_BITS = 4  # a subnormal with this many significant bits or fewer counts as lost
REL_ERROR = 0.25  # a layer whose gradient is this far (relative L2) from fp32's is wrong


def _rows(run: Run, phase: str) -> list[tuple[OpEvent, list[float]]]:
    return [(e, run.stats[e.row]) for e in run.events if e.row is not None and e.phase == phase]


def absorbed_overflow(low: Run, ref: Run, twin: Any) -> dict[str, Any] | None:
    """The first forward op that overflowed although the loss stayed finite, and its consumer.

    ``twin(run, event, other)`` is the caller's aligner: ``event``'s numbers in ``other`` (or
    None). Returns ``{"event": OpEvent, "consumer": OpEvent | None}``, or None when no forward
    op made a new non-finite value, or fp32 is non-finite there too. Cost: none (host lists).
    """
    rows = _rows(low, "forward")
    for i, (e, row) in enumerate(rows):
        if not is_new(row, e.intentional):
            continue
        ref_row = twin(low, e, ref)
        if ref_row is None or not (ref_row[1] >= 0 and math.isfinite(ref_row[1])):
            return None  # fp32 overflows too (or cannot be aligned): not a precision problem
        consumer = next(
            (
                c
                for c, r in rows[i + 1 :]
                if not math.isfinite(r[0]) and r[1] >= 0 and math.isfinite(r[1])
            ),
            None,
        )
        return {"event": e, "consumer": consumer}
    return None


def partial_underflow(low: Run, ref: Run) -> dict[str, Any] | None:
    """The layer losing the largest share of its gradient to low precision, if above
    :data:`UNDERFLOW_SHARE`.

    An element is lost when fp32 has it nonzero and the low run holds an exact zero (flushed),
    or a subnormal with at most :data:`LOSSY_BITS` significant bits (counted only for
    gradients that came out of the low-precision backward: their values are exactly
    representable in it). A layer is the module that owns the parameter. Returns ``{"module",
    "share", "layers": {module: share}, "flushed", "lossy", "nonzero_fp32", "threshold"}`` or
    None. Cost: a few elementwise ops per gradient and one host sync.
    """
    entry = precisions.REGISTRY.get(low.precision)
    dtype = None if entry is None else dtype_of(entry.low_dtype)  # None: full precision
    names = [n for n in low.order if n in low.grad_tensors and n in ref.grad_tensors]
    if dtype is None or not names:
        return None
    info = torch.finfo(dtype)
    # a subnormal with k significant bits is below smallest_normal * eps * 2**k
    lossy_below = info.smallest_normal * info.eps * 2.0**LOSSY_BITS
    parts = []
    for n in names:
        g, r = low.grad_tensors[n].float(), ref.grad_tensors[n].float()
        nonzero = r != 0
        exact = (g.to(dtype).float() == g).all()
        small = (g != 0) & (g.abs() < lossy_below) & exact
        parts.append(
            torch.stack(
                [nonzero.sum(), ((g == 0) & nonzero).sum(), (small & nonzero).sum()]
            ).float()
        )
    counts = torch.stack(parts).tolist()
    layers: dict[str, list[float]] = {}
    for n, (nonzero, flushed, lossy) in zip(names, counts, strict=True):
        acc = layers.setdefault(n.rpartition(".")[0], [0.0, 0.0, 0.0])
        acc[0] += nonzero
        acc[1] += flushed
        acc[2] += lossy
    shares = {m: (f + s) / z for m, (z, f, s) in layers.items() if z > 0}
    if not shares:
        return None
    worst = max(shares, key=lambda m: shares[m])
    if shares[worst] <= UNDERFLOW_SHARE:
        return None
    z, f, s = layers[worst]
    return {
        "module": worst,
        "share": shares[worst],
        "layers": {m: round(v, 4) for m, v in shares.items() if v > UNDERFLOW_SHARE},
        "flushed": int(f),
        "lossy": int(s),
        "nonzero_fp32": int(z),
        "threshold": UNDERFLOW_SHARE,
        "lossy_bits": LOSSY_BITS,
    }


def grad_errors(low: Run, ref: Run) -> dict[str, float]:
    """Per layer (the module owning the parameters), the relative L2 error of the low-precision
    gradient against fp32's, both unscaled: ``||g/scale - r|| / ||r||`` over the layer's
    parameters; layers whose fp32 gradient is zero are left out. Cost: two reductions per
    gradient and one host sync."""
    names = [n for n in low.order if n in low.grad_tensors and n in ref.grad_tensors]
    if not names:
        return {}
    parts = []
    for n in names:
        g = low.grad_tensors[n].float() / low.scale
        r = ref.grad_tensors[n].float() / ref.scale
        parts.append(torch.stack([(g - r).pow(2).sum(), r.pow(2).sum()]))
    sums = torch.stack(parts).tolist()
    layers: dict[str, list[float]] = {}
    for n, (err, norm) in zip(names, sums, strict=True):
        acc = layers.setdefault(n.rpartition(".")[0], [0.0, 0.0])
        acc[0] += err
        acc[1] += norm
    return {m: math.sqrt(e / z) for m, (e, z) in layers.items() if z > 0 and math.isfinite(e)}
