"""What a report shows for a run without a loss scale (bf16, fp32, fp8, mxfp8, nvfp4, an fp16
loop without a scaler, DeepSpeed bf16): what ran instead of a loss scale, never an fp16
scaler configuration and a flat 2^0 scale panel.

:func:`without_loss_scale` tells such a run from its ``meta.json`` (the precision's registry
entry says it uses no loss scale, or no scaler configuration was recorded); :func:`what_ran`
is one sentence for the metadata table and the place of the scale panel, naming the layers a
converting precision (fp8, mxfp8, nvfp4) ran in its format.
"""

from __future__ import annotations

from typing import Any

from ampguard import precisions
from ampguard.runlog import RunLog

__all__ = ["without_loss_scale", "what_ran", "converted_layers"]

_SHOWN = 8  # layer names listed before "... and N more"


def without_loss_scale(run: RunLog) -> bool:
    """True when the run trained without a loss scale (its scale is 1 by construction)."""
    entry = precisions.REGISTRY.get(str(run.meta.get("precision")))
    if entry is not None and entry.loss_scale == "none":
        return True
    return "init_scale" not in run.scaler_config()


def converted_layers(run: RunLog) -> list[str] | None:
    """The layers a converting precision ran in its format (``meta.json``), or None."""
    for key in ("fp8", "lowp", "conversion"):
        info = run.meta.get(key)
        if isinstance(info, dict) and isinstance(info.get("converted"), list):
            return [str(n) for n in info["converted"]]
    return None


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    more = len(names) - _SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def what_ran(run: RunLog) -> str:
    """One sentence: the precision that ran, why it needs no loss scale, and (fp8, mxfp8,
    nvfp4) which layers ran in the format."""
    meta: dict[str, Any] = run.meta
    name = str(meta.get("precision"))
    requested = meta.get("requested_precision")
    head = name if not requested or requested == name else f"{name} (requested {requested})"
    entry = precisions.REGISTRY.get(name)
    if entry is not None and entry.low_dtype == "float16":
        why = "fp16 without a loss scaler: small gradients flush to zero (see AG171)"
    elif entry is not None and entry.hook is not None:  # converted layers: fp8, mxfp8, ...
        why = "each tensor or block carries its own scale"
    elif entry is not None and entry.is_full:
        why = "full precision"
    else:
        why = "bf16 has fp32's exponent range"
    text = f"{head}, no loss scale ({why})"
    layers = converted_layers(run)
    if layers is not None:
        text += (
            f"; {len(layers)} layer(s) ran in {name}: {_names(layers)}; the rest in bf16"
            if layers
            else f"; no layer ran in {name}"
        )
    engine = meta.get("engine") or {}
    if isinstance(engine, dict) and engine.get("name"):
        text += f"; {engine['name']} engine"
        if engine.get("clip_grad_norm") is not None:
            text += f" clipping at {engine['clip_grad_norm']:g}"
    return text + "."
