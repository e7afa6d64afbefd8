"""The Guard's precision conversion: built through the registry entry's hook.

A precision whose registry entry names a conversion hook (``Precision.hook``; fp8's is
:class:`ampguard.fp8._convert.Fp8State`, mxfp8's and nvfp4's
:class:`ampguard.fp8._block.BlockScaled`) gets it here, as ``hook(model, device, plan)``, typed
as :class:`ampguard.fp8._conversion.Conversion` (what the Guard uses of it): the plan is
checked and the layers chosen, without touching the model (the Guard converts them last, so a
constructor that raises leaves the model as it was). When the conversion chose no layer,
nothing would compute in the format: the Guard trains in :data:`UNCONVERTED` (bf16) and says
so, ``guard.precision == "bf16"`` (the run log records ``precision: "bf16"``,
``requested_precision: "fp8"``), with a ``RuntimeWarning``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ampguard import precisions
from ampguard._util.stack import user_stacklevel
from ampguard.core.policy import PrecisionPolicy, resolve_precision
from ampguard.fp8 import Conversion

__all__ = ["UNCONVERTED", "attach"]

UNCONVERTED = "bf16"  # what a converting precision trains in when no layer converts


def attach(
    policy: PrecisionPolicy,
    requested: str,
    model: torch.nn.Module,
    device: torch.device,
    plan: Any,
) -> tuple[Conversion | None, PrecisionPolicy]:
    """The conversion of ``policy``'s precision (None when it has no hook) and the precision the
    Guard trains in. ``ValueError`` for an ``fp8_plan`` given to a precision without one."""
    hook = policy.entry.load_hook()
    if hook is None:
        if plan is not None:
            converting = [n for n, p in precisions.REGISTRY.items() if p.hook is not None]
            raise ValueError(
                f"fp8_plan is only used with precision={' or '.join(map(repr, converting))}, "
                f"got precision={requested!r}"
            )
        return None, policy
    conversion: Conversion = hook(model, device, plan)
    if conversion.chosen:
        return conversion, policy
    # before telemetry records the precision: say what runs, not what was asked
    warnings.warn(
        f"precision={policy.precision!r}: no Linear layer is converted (none eligible, or the "
        f"plan keeps them all in {UNCONVERTED}); training runs in {UNCONVERTED} "
        f"(guard.precision is {UNCONVERTED!r}, guard.requested_precision {requested!r})"
        + _unconvertible_note(model),
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
    return conversion, resolve_precision(UNCONVERTED, device)


def _unconvertible_note(model: torch.nn.Module) -> str:
    """The matmul modules that are not nn.Linear (transformers Conv1D ...), and the fix."""
    from ampguard.fp8 import CONV1D_FIX, is_hf_conv1d, unconvertible

    names = list(unconvertible(model))
    if not names:
        return ""
    shown = ", ".join(n or "(root)" for n in names[:6]) + (", ..." if len(names) > 6 else "")
    conv1d = any(is_hf_conv1d(m) for m in model.modules())
    return f". Not nn.Linear, so never eligible: {shown}" + (
        f". Fix for transformers Conv1D: {CONV1D_FIX}" if conv1d else ""
    )
