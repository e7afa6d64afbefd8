"""The low-precision formats of :func:`ampguard.locate`: a replay in ``"fp8"``, ``"mxfp8"``,
``"nvfp4"`` or ``"fp8_blockwise"`` trains every Linear layer that fits the format by emulation.

A precision with a conversion hook changes the model, which autocast alone cannot replay; for
the low-precision formats the change is known exactly: every matmul operand of a fitting
``nn.Linear`` quantised as the format stores it (:func:`ampguard.fp8._emulate.emulate`, the
plan's casts, bitwise torchao's), under the entry's bf16 autocast. ``fp8`` replays torchao
float8's default recipe (``tensorwise``). :func:`emulating` converts for one replay and puts the
layers back (their class only: parameters and state are never touched), failure or not. No
torchao is needed. Cost: that of the emulated matmuls (see :mod:`ampguard.fp8._emulate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ampguard.precisions import REGISTRY

__all__ = ["FP8_FORMAT", "emulated_format", "emulating"]

FP8_FORMAT = "tensorwise"  # what precision="fp8" replays: torchao float8's default recipe


def emulated_format(precision: str) -> str | None:
    """The low-precision format a replay of ``precision`` emulates, None for a precision that
    autocast alone reproduces (fp16, bf16, fp32)."""
    entry = REGISTRY.get(precision)
    if entry is None or entry.hook is None:
        return None
    return str(getattr(entry.load_hook(), "format", FP8_FORMAT))


@contextlib.contextmanager
def emulating(model: nn.Module, precision: str) -> Iterator[list[str]]:
    """Within the block, ``model``'s fitting Linear layers compute in ``precision``'s format
    (their names yielded; nothing for an autocast-only precision); restored on exit."""
    fmt = emulated_format(precision)
    if fmt is None:
        yield []
        return
    from ampguard.fp8 import emulate, restore

    layers = emulate(model, fmt)
    try:
        yield layers
    finally:
        for name in layers:
            restore(model.get_submodule(name))
