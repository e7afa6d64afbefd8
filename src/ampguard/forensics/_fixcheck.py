"""Fixes that fix: check the ``keep_fp32`` a diagnosis advises, and name an eps fp16 cannot hold.

:func:`locate` diagnoses an fp16 overflow at a module and would advise keeping that module in
fp32. Two things can make that advice wrong, and both are checked here:

- The fp32 module's *gradient* is cast back to fp16 where its input was made, and overflows
  there: the fix only moves the overflow into the backward pass (an fp32 norm whose input
  gradient is ``1 / sqrt(eps)`` times larger). :func:`check_keep_fp32` replays the batch with the
  module in fp32 and says where it still breaks, so the advice can name what else is needed
  (the neighbour on the gradient path in fp32 too, or bf16).
- The root cause is an ``eps`` below fp16's smallest subnormal (2**-24, about 6e-8; ``1e-12`` is
  a common one) that rounds to 0, so ``var + eps`` is 0 on a row whose variance is 0 and the
  division makes inf/NaN. :func:`tiny_eps` names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampguard import precisions
from ampguard.core.policy import dtype_of
from ampguard.forensics._optrace import OpEvent
from ampguard.forensics._replay import Preserved, Run, replay
from ampguard.forensics.islands import Fp32Islands

__all__ = ["FP16_SUBNORMAL", "check_keep_fp32", "tiny_eps", "keep_fp32_text", "eps_text"]

FP16_SUBNORMAL = 2.0**-24  # fp16's smallest subnormal: anything below rounds to 0
_EPS_NAMES = ("eps", "epsilon", "variance_epsilon", "norm_eps", "layer_norm_eps")


def tiny_eps(model: torch.nn.Module, module: str | None, precision: str) -> list[dict[str, Any]]:
    """``[{"module", "attribute", "value"}]``: float eps-like attributes of ``module`` and its
    submodules that round to 0 in the precision's low dtype (0 < eps < its smallest subnormal:
    2**-24 in fp16). Empty under fp32 and, in practice, bf16 (its range holds them) or when there
    is no such module. Cost: host only."""
    entry = precisions.REGISTRY.get(precision)
    low = None if entry is None else dtype_of(entry.low_dtype)
    if low is None or module is None:
        return []
    info = torch.finfo(low)
    smallest = info.smallest_normal * info.eps  # the smallest subnormal (fp16: 2**-24)
    root = dict(model.named_modules()).get(module)
    if root is None:
        return []
    out = []
    for name, sub in root.named_modules(prefix=module):
        for attr, value in vars(sub).items():
            if (
                isinstance(value, float)
                and (attr.lower() in _EPS_NAMES or attr.lower().endswith("_eps"))
                and 0.0 < value < smallest
            ):
                out.append({"module": name, "attribute": attr, "value": value})
    return out


def check_keep_fp32(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    batch: Any,
    policy: Any,
    scale: float,
    keep: Preserved,
    module: str,
    first_new: Callable[[Run], OpEvent | None],
) -> dict[str, Any]:
    """Replay ``batch`` with ``module`` kept in fp32 (at ``scale``, and at scale 1 if the
    backward still overflows there). Returns ``{"modules", "finite", "finite_at_scale_1"}``
    plus ``{"phase", "module", "op"}`` of the first op that is still non-finite.
    Cost: one or two more traced forward+backward passes and their host syncs."""
    islands = Fp32Islands(model)
    islands.add(module)
    try:
        keep.reset()
        run = replay(model, loss_fn, batch, policy, scale)
        at_one = run
        if run.failed and scale > 1.0:
            keep.reset()
            at_one = replay(model, loss_fn, batch, policy, 1.0)
    finally:
        islands.remove()
    out: dict[str, Any] = {
        "modules": [module],
        "finite": not run.failed,
        "finite_at_scale_1": not at_one.failed,
        "scale": scale,
    }
    e = first_new(run) if run.failed else None
    if e is not None:
        out.update(phase=e.phase, module=e.module, op=e.op)
    return out


def eps_text(found: list[dict[str, Any]]) -> str:
    """The sentence that names the eps (empty when none was found)."""
    if not found:
        return ""
    e = found[0]
    return (
        f" The root cause is {e['module']!r}.{e['attribute']} = {e['value']:g}: below fp16's "
        f"smallest subnormal ({FP16_SUBNORMAL:.2g}) it rounds to 0 in fp16, so a variance (or "
        "norm) that is 0 or flushes to 0 is divided by exactly 0."
    )


def keep_fp32_text(d: Any) -> str | None:
    """The fp16-overflow fix, from what :func:`check_keep_fp32` and :func:`tiny_eps` found;
    None when neither ran (the plain advice stands)."""
    s = d.stats
    check, eps = s.get("keep_fp32_check"), s.get("tiny_eps") or []
    if check is None and not eps:
        return None
    name = d.module
    parts = []
    if eps:
        e = eps[0]
        parts.append(
            f"Raise {e['module']!r}.{e['attribute']} to a value fp16 holds (1e-5, torch's "
            "LayerNorm default, or more), or compute that norm in fp32."
        )
    if check is None or check["finite"]:
        verified = " (checked: with it this batch is finite)" if check else ""
        parts.append(f"Keep {name!r} in fp32: Guard(..., keep_fp32=[{name!r}]){verified}.")
    elif check.get("phase") == "backward" and check.get("module") not in (None, name):
        nxt = check["module"]
        scale_note = (
            "at every loss scale"
            if not check["finite_at_scale_1"]
            else f"at loss scale {check['scale']:g} (finite at scale 1 on this batch: the "
            "scaler would have to stay near 1)"
        )
        parts.append(
            f"keep_fp32=[{name!r}] alone is not enough: with {name!r} in fp32 the backward pass "
            f"still overflows {scale_note}, at {check.get('op')} in {nxt!r} (the fp32 "
            f"gradient is cast back to fp16 there). Keep the gradient path in fp32 too: "
            f"Guard(..., keep_fp32=[{name!r}, {nxt!r}])."
        )
    else:
        where = check.get("module")
        parts.append(
            f"keep_fp32=[{name!r}] alone is not enough: with {name!r} in fp32 the "
            f"{check.get('phase') or 'training'} pass still goes non-finite"
            + (f" at {check.get('op')} in {where!r}" if where is not None else "")
            + "."
        )
    parts.append("Or train in bf16 (precision='bf16'), whose range holds these values.")
    return " ".join(parts)
