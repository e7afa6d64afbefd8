"""Precisions as values: one :class:`Precision` entry per precision ampguard can train in.

Every fact that used to be a string comparison (``precision == "fp16"``) is a field here: the
autocast dtype, the dtype activations and gradients are rounded to, whether a loss scaler is
needed, whether the device must support bf16 autocast, what the parameters must be, whether
``ag.watch`` can observe it, the stable code ranks exchange in the distributed audit, and the
conversion hook that prepares the model (fp8: torchao's ``Float8Linear``). The CLI's choices, the
validators' messages and the docs' precision table (``tools/gen_docs.py``) read from
:data:`REGISTRY`; adding a precision is one entry here plus its hook.

Code elsewhere asks the registry, never a name: :func:`full` (the fp32 reference),
:func:`scaled` (what a loss scaler trains), :func:`traced` (what a trace under autocast sees
whole: ``ag.locate``/``ag.coverage``), :func:`watched_as` (what ``ag.watch`` records a run as),
:func:`label` (the short name of a dtype), and :func:`checked` for a framework's own name map
(Lightning's ``"16-mixed"``, Accelerate's ``"no"``), whose values must be registered.
``tests/test_precisions.py`` fails on a module that compares a variable with a precision name.

The registry imports nothing (not torch either: ``ampguard lint`` and the CLI's argument parser
read it and start fast), so dtypes are torch attribute names (``"float16"``) that
:mod:`ampguard.core.policy` resolves, and a hook is named as ``"module:attribute"`` rather than
imported: the registry sits under the packages that implement hooks (``ampguard.fp8``), and the
Guard loads the hook with :meth:`Precision.load_hook` when it is built
(``tests/test_architecture.py`` checks that every named hook lives in a layer the Guard may
import). Nothing here touches a device.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AUTO",
    "Precision",
    "REGISTRY",
    "get",
    "names",
    "requests",
    "by_audit_code",
    "full",
    "single_format",
    "scaled",
    "traced",
    "watched_as",
    "label",
    "checked",
]

AUTO = "auto"  # a request, not a precision: bf16 where the device supports it, else fp16


@dataclass(frozen=True)
class Precision:
    """One precision: what autocast runs, what is rounded, what it needs.

    ``autocast_dtype`` names the torch dtype autocast runs (``None``: autocast off, fp32).
    ``low_dtype`` names the dtype whose range limits activations and gradients (fp16, bf16;
    ``None`` for fp32). ``loss_scale`` is ``"dynamic"`` where gradients underflow without scaling
    (fp16), ``"static"`` for a fixed scale and ``"none"`` elsewhere (the Guard builds the
    matching :mod:`ampguard.core.loss_scale` implementation). ``refused_params`` names a
    parameter dtype the precision cannot train (fp16's scaler needs fp32 master weights),
    ``param_advice`` says why and what to do instead. ``hook`` names the model conversion run
    when a Guard is built (``None``: no conversion); ``extra`` is the pip extra that hook needs.
    ``audit_code`` is append-only: ranks exchange it. ``formats`` names the low-precision
    formats its conversion trains Linear layers in, in the plan's vocabulary
    (``ampguard.fp8.FORMATS``, what ``ag.fp8_plan(formats=...)`` measures): a precision that is
    one format carries that format's name (``mxfp8``), so compare's variants, the plan and the
    Guard say the same word.
    """

    name: str
    summary: str
    autocast_dtype: str | None
    low_dtype: str | None
    loss_scale: str  # "dynamic" | "static" | "none" (ampguard.core.loss_scale.KINDS)
    needs_bf16: bool
    audit_code: int
    watchable: bool = True
    refused_params: str | None = None
    param_advice: str = ""
    hook: str | None = None
    extra: str | None = None
    formats: tuple[str, ...] = ()
    by_name: bool = True  # False: chosen by passing its value (a recipe), not a CLI choice

    @property
    def needs_scaler(self) -> bool:
        """True where gradients underflow without a loss scale (the Guard builds a scaler)."""
        return self.loss_scale != "none"

    @property
    def is_full(self) -> bool:
        """True for full precision (autocast off): the reference a low precision is judged by."""
        return self.autocast_dtype is None

    @property
    def autocast_only(self) -> bool:
        """True for a low precision that is autocast and nothing else (no conversion hook): a
        trace of the model under its autocast sees everything it changes (``ag.locate``,
        ``ag.coverage`` accept these)."""
        return not self.is_full and self.hook is None

    def load_hook(self) -> Any:
        """The conversion hook (imported on first use), or ``None`` for a precision without."""
        if self.hook is None:
            return None
        module, _, attribute = self.hook.partition(":")
        return getattr(importlib.import_module(module), attribute)


REGISTRY: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(
            name="fp16",
            summary="float16 autocast with a dynamic loss scale (fp32 master weights)",
            autocast_dtype="float16",
            low_dtype="float16",
            loss_scale="dynamic",
            needs_bf16=False,
            audit_code=2,
            refused_params="float16",
            param_advice=(
                "precision='fp16' uses a loss scaler, which needs fp32 master weights: fp16 "
                "updates underflow and torch refuses to unscale fp16 gradients. Keep the model "
                "in float32 and let autocast run the fp16 math (remove .half()), or use "
                "precision='bf16'."
            ),
        ),
        Precision(
            name="bf16",
            summary="bfloat16 autocast; fp32's range, so no loss scale",
            autocast_dtype="bfloat16",
            low_dtype="bfloat16",
            loss_scale="none",
            needs_bf16=True,
            audit_code=1,
        ),
        Precision(
            name="fp32",
            summary="autocast off: the full-precision reference",
            autocast_dtype=None,
            low_dtype=None,
            loss_scale="none",
            needs_bf16=False,
            audit_code=0,
        ),
        Precision(
            name="fp8",
            summary="bf16 autocast plus torchao float8 training of the Linear layers a plan allows",
            autocast_dtype="bfloat16",
            low_dtype="bfloat16",
            loss_scale="none",  # fp8 scales every tensor by its own amax
            needs_bf16=True,
            audit_code=3,
            watchable=False,
            hook="ampguard.fp8._convert:Fp8State",
            extra="fp8",
            formats=("tensorwise", "rowwise"),  # the plan's recipes
        ),
        Precision(
            name="mxfp8",
            summary="bf16 autocast; the Linear layers that fit train in MXFP8 (emulated)",
            autocast_dtype="bfloat16",
            low_dtype="bfloat16",
            loss_scale="none",  # a scale per block of 32
            needs_bf16=True,
            audit_code=4,
            watchable=False,
            hook="ampguard.fp8._block:Mxfp8",
            formats=("mxfp8",),
        ),
        Precision(
            name="nvfp4",
            summary="bf16 autocast; the Linear layers that fit train in NVFP4 (emulated)",
            autocast_dtype="bfloat16",
            low_dtype="bfloat16",
            loss_scale="none",  # a scale per block of 16 and one per tensor
            needs_bf16=True,
            audit_code=5,
            watchable=False,
            hook="ampguard.fp8._block:Nvfp4",
            formats=("nvfp4",),
        ),
        Precision(
            name="fp8_blockwise",
            summary=(
                "bf16 autocast; the Linear layers that fit train in block-wise fp8 (1x128 "
                "tiles, 128x128 weight blocks; emulated)"
            ),
            autocast_dtype="bfloat16",
            low_dtype="bfloat16",
            loss_scale="none",  # a scale per tile / block
            needs_bf16=True,
            audit_code=6,
            watchable=False,
            hook="ampguard.fp8._block:Fp8Blockwise",
            formats=("fp8_blockwise",),
        ),
        Precision(
            name="recipe",
            summary=(
                "bf16 autocast; each Linear in the format a {layer: format} recipe or a "
                "certificate names (emulated): Guard(precision=<dict or certificate>)"
            ),
            autocast_dtype="bfloat16",
            low_dtype="bfloat16",
            loss_scale="none",
            needs_bf16=True,
            audit_code=7,
            watchable=False,
            hook="ampguard.fp8._layered:LayerRecipe",
            by_name=False,
        ),
    )
}


def names(*, watchable: bool = False) -> tuple[str, ...]:
    """The registered precisions, in registry order (only those ``ag.watch`` observes with
    ``watchable=True``)."""
    return tuple(n for n, p in REGISTRY.items() if p.watchable or not watchable)


def requests(*, by_name: bool = False) -> tuple[str, ...]:
    """What ``precision=`` accepts: ``"auto"`` and every registered precision (with
    ``by_name=True`` only those a name alone selects: the CLI's choices)."""
    return (AUTO, *(n for n in names() if REGISTRY[n].by_name or not by_name))


def get(
    name: str, *, argument: str = "precision", allowed: tuple[str, ...] | None = None
) -> Precision:
    """The entry for ``name``; ``ValueError`` naming ``argument`` and what is allowed otherwise."""
    allowed = names() if allowed is None else allowed
    if name not in allowed or name not in REGISTRY:
        raise ValueError(f"{argument} must be one of {allowed}, got {name!r}")
    return REGISTRY[name]


def by_audit_code(code: int) -> str:
    """The precision a rank reported by its audit code (``unknown(N)`` for a code not here)."""
    for p in REGISTRY.values():
        if p.audit_code == code:
            return p.name
    return f"unknown({code})"


def single_format() -> tuple[str, ...]:
    """The precisions that are one plan format, named as the format (``mxfp8``, ``nvfp4``):
    what compare trains as its block-scaled variants."""
    return tuple(n for n, p in REGISTRY.items() if p.formats == (n,))


def full() -> str:
    """The full-precision reference (autocast off, ``"fp32"``): what a low precision is judged by
    and what a framework that runs no autocast trains in."""
    return next(n for n, p in REGISTRY.items() if p.is_full)


def scaled() -> str:
    """The precision a loss scaler trains (``"fp16"``): what a run with an enabled
    ``GradScaler`` is, whatever its framework was asked for."""
    return next(n for n, p in REGISTRY.items() if p.needs_scaler)


def traced(*, with_auto: bool = True) -> tuple[str, ...]:
    """The low precisions a trace under autocast sees whole (:attr:`Precision.autocast_only`),
    with ``"auto"`` first unless ``with_auto=False``: what ``ag.locate`` and ``ag.coverage``
    accept."""
    low = tuple(n for n, p in REGISTRY.items() if p.autocast_only)
    return (AUTO, *low) if with_auto else low


def watched_as(name: str) -> str:
    """The precision ``ag.watch`` records a run of ``name`` as: ``name`` itself where it is
    :attr:`~Precision.watchable`, else the first watchable entry with the same autocast dtype
    and loss scale (fp8 -> bf16: attach mode sees the autocast, not the converted layers)."""
    p = get(name, argument="name")
    if p.watchable:
        return name
    for n, q in REGISTRY.items():
        if q.watchable and (q.autocast_dtype, q.loss_scale) == (p.autocast_dtype, p.loss_scale):
            return n
    raise ValueError(f"ag.watch cannot observe precision {name!r} (no watchable entry like it)")


_FULL_DTYPE = "float32"  # what full precision computes in (its entry has no low dtype)


def label(dtype: str) -> str:
    """The short name ampguard prints for a torch dtype name: the first entry without a
    conversion hook that rounds to it (``"float16"`` -> ``"fp16"``, ``"bfloat16"`` -> ``"bf16"``,
    ``"float32"`` -> ``"fp32"``); the dtype name itself when no entry does."""
    for n, p in REGISTRY.items():
        if p.hook is None and (p.low_dtype or _FULL_DTYPE) == dtype:
            return n
    return dtype


def checked(mapping: dict[str, str], *, source: str) -> dict[str, str]:
    """``mapping`` (a framework's own precision names -> ampguard's), after checking that every
    value is a registered precision; ``ValueError`` naming ``source`` otherwise. Frameworks keep
    their own vocabulary ("16-mixed", "no"); what it maps to is the registry's."""
    bad = sorted({v for v in mapping.values() if v not in REGISTRY})
    if bad:
        raise ValueError(f"{source} maps to unregistered precisions {bad}; registered: {names()}")
    return mapping
