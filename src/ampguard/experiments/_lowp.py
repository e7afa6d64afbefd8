"""Block-scaled variants of :func:`ampguard.compare`: ``mxfp8`` and ``nvfp4`` train every Linear
layer that fits the format (:func:`ampguard.fp8._emulate.emulate`: torchao's quantisers on every
matmul operand, the matmul in float32) under bf16 autocast, and are judged against bf16 like the
fp8 variants: ``cmp.extra["lowp"][name]`` holds ``like_bf16``, the gap to bf16's final loss and
the converted layers, and the summary prints one line per variant. On a machine without torchao
the variant fails before any variant runs, with the ``pip install "ampguard[fp8]"`` error.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LOWP_VARIANTS", "prepare", "judge_lowp", "lowp_lines"]

LOWP_VARIANTS = {
    "mxfp8": "MXFP8 (e4m3, a scale per 32) for every fitting Linear, emulated; bf16 around it",
    "nvfp4": "NVFP4 (e2m1, scales per 16 and per tensor) for every fitting Linear, emulated",
    "fp8_blockwise": "block-wise fp8 (1x128 tiles, 128x128 weight blocks) per fitting Linear",
}


def prepare(name: str, model: Any) -> list[str]:
    """Convert ``model`` for variant ``name``; the names of the converted layers."""
    from ampguard.fp8._emulate import emulate

    return emulate(model, name)


def judge_lowp(cmp: Any, bf16_again: Any = None) -> None:
    """Judge each block-scaled variant that ran against bf16 (``cmp.extra["lowp"]``), with the
    fp8 variants' tolerance: bf16's run-to-run noise (``bf16_again``, the next seed's run)."""
    from ampguard.experiments._fp8 import _like_bf16, bf16_noise, tolerance

    bf16 = cmp.variants.get("bf16")
    runs = [cmp.variants[n] for n in LOWP_VARIANTS if n in cmp.variants]
    if bf16 is None or not runs:
        return
    noise = bf16_noise(bf16, bf16_again) if bf16_again is not None else math.nan
    tol = tolerance(bf16, noise)
    cmp.extra["lowp"] = {
        r.name: {
            "like_bf16": _like_bf16(r, bf16, tol),
            "gap_to_bf16": r.gap_to_bf16,
            "converted": list(getattr(r, "converted", [])),
        }
        for r in runs
    }


def lowp_lines(cmp: Any) -> list[str]:
    """One summary line per block-scaled variant ([] when none ran)."""
    out = []
    for name, info in cmp.extra.get("lowp", {}).items():
        gap = info["gap_to_bf16"]
        verdict = "trains like bf16" if info["like_bf16"] else "does NOT train like bf16"
        gap_text = "" if gap is None else f" (final loss gap to bf16 {gap:+.4g})"
        out.append(
            f"{name} (emulated, {len(info['converted'])} Linear layers): {verdict}{gap_text}"
        )
    return out
