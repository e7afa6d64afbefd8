"""The model advisor: static AMP hazards, and an fp32 range probe that predicts fp16 trouble.

``inspect_model(model)`` looks at the model (and optimizer) without running it. Given a batch it
also runs one fp32 forward/backward and predicts, per module, what fp16 would do to the values it
saw: activations past 65504 (overflow), gradients past 65504 even at loss scale 1, gradients or
activations flushed to zero, sigmoid/tanh outputs rounded to 1. From that it proposes a precision
plan: fp16 (with a ``keep_fp32`` list for the few modules that overflow), or bf16.

Codes: AG320 BatchNorm-heavy model; AG321 saturating activations; AG322 custom autograd.Function
without custom_fwd/custom_bwd; AG323 optimizer trains fp16 parameters; AG324 Adam eps rounds to 0 in
half precision; AG325 modules already .half(); AG326 fp16 forward overflow predicted; AG327
activations within 8x of fp16's max; AG328 gradients overflow fp16 at any loss scale; AG329
gradients flushed to zero at the usable scale; AG330 activations flushed to zero; AG331 the
precision plan; AG332 non-finite values already in fp32 (not an AMP problem); AG361/AG362 inside
modules and AG363 an fp16 op of the loss code (outside every module) that overflows or underflows,
named with its source line (:mod:`ampguard.experiments._loss_probe`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampguard.experiments._advisor_probe import merge_saturation, probe_findings
from ampguard.experiments._inner_probe import inner_findings
from ampguard.experiments._range_probe import run_probe
from ampguard.findings import Finding, make

__all__ = ["inspect_model"]

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_SATURATING = (nn.Sigmoid, nn.Tanh, nn.Softsign, nn.Hardsigmoid, nn.Hardtanh)
_ADAM_LIKE = (
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "SparseAdam",
    "Adagrad",
    "RMSprop",
    "Adadelta",
)


def inspect_model(
    model: nn.Module | Any,
    batch: Any = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[Finding]:
    """Static AMP checks of ``model`` and, given ``batch``, an fp32 probe with a precision plan.

    ``loss_fn(model, batch) -> scalar loss`` enables the gradient checks; without it the batch is
    passed to the model as ``model(batch)`` and only activations are probed. ``model`` may also be
    an :class:`ampguard.Experiment`: its optimizer, first batch and loss_fn are used unless given.
    The model's buffers, gradients and RNG state are restored after the probe. With ``loss_fn``
    the loss code is probed too: an fp16 op outside every module that overflows or flushes its
    values is AG363, with its source line and the fix that applies there.

    Cost: without a batch, none (no host sync). With a batch, one fp32 forward and backward with
    a host sync per module output and gradient, then one fp16 autocast forward traced op by op
    (no grad; one host sync).

    >>> findings = ag.inspect_model(model, (x, y), lambda m, b: F.mse_loss(m(b[0]), b[1]))
    >>> [f.code for f in findings]
    ['AG331']
    """
    model, batch, loss_fn, optimizer = _unpack(model, batch, loss_fn, optimizer)
    functions = _referenced_functions(model)
    probe = None if batch is None else run_probe(model, batch, loss_fn)
    if probe is not None:
        for cls in probe.functions:
            if _is_custom_function(cls):
                functions.setdefault(cls, [])
    findings = _static_findings(model, optimizer, functions)
    if probe is not None:
        # inside modules (AG361/AG362) only when fp32 itself is finite (else AG332 says it all)
        inner = inner_findings(model, batch, loss_fn, probe)
        inside = [m for f in inner if f.code == "AG361" for m in f.evidence["modules"]]
        findings = merge_saturation(findings, probe) + probe_findings(model, probe, inside)
        findings += inner
    return findings


def _unpack(model: Any, batch: Any, loss_fn: Any, optimizer: Any) -> tuple:
    from ampguard.experiments import Experiment

    if isinstance(model, Experiment):
        exp = model
        model, optimizer = exp.model, optimizer if optimizer is not None else exp.optimizer
        loss_fn = loss_fn if loss_fn is not None else exp.loss_fn
        if batch is None:
            batch = next(iter(exp.batches), None)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module or an ampguard.Experiment, got {type(model).__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}"
        )
    if loss_fn is not None and batch is None:
        raise ValueError("loss_fn was given without a batch: pass batch= to probe the model")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    return model, batch, loss_fn, optimizer


# ----------------------------------------------------------------------------- static checks


def _static_findings(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, functions: dict[type, list[str]]
) -> list[Finding]:
    """The checks that need no data: module types, parameter dtypes, optimizer settings."""
    out = [
        _batchnorm_heavy(model),
        _saturating(model),
        _half_modules(model),
        _custom_function_finding(functions),
    ]
    if optimizer is not None:
        out += [_fp16_optimizer_params(optimizer), _adam_eps(optimizer)]
    return [f for f in out if f is not None]


def _batchnorm_heavy(model: nn.Module) -> Finding | None:
    bns = [n for n, m in model.named_modules() if isinstance(m, _BATCHNORMS)]
    weighted = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if len(bns) < 2 or len(bns) < 0.25 * len(weighted):
        return None
    return make(
        "AG320",
        f"{len(bns)} of {len(weighted)} parameterised modules are BatchNorm. Under fp16 autocast "
        "they normalise fp16 activations; one overflowing batch writes inf/NaN into "
        "running_mean/running_var, which then poisons every eval forward, even after the scaler "
        "skipped that step.",
        evidence={"modules": bns[:20], "count": len(bns)},
        fix="Prefer precision='bf16'; under fp16 keep every BatchNorm in fp32 "
        f"(Guard(..., keep_fp32={_class_list(model, _BATCHNORMS)})) and check running stats for "
        "non-finite values.",
    )


def _class_list(model: nn.Module, kinds: tuple[type, ...]) -> str:
    """``[torch.nn.BatchNorm2d, ...]``: the classes of ``model``'s modules that are ``kinds``,
    as code that matches all of them (``keep_fp32`` takes module classes), never a truncated
    list of names."""
    seen: dict[type, None] = {}
    for m in model.modules():
        if isinstance(m, kinds):
            seen.setdefault(type(m), None)
    return "[" + ", ".join(_class_path(c) for c in seen) + "]"


def _class_path(cls: type) -> str:
    if getattr(nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _saturating(model: nn.Module) -> Finding | None:
    names = [n for n, m in model.named_modules() if isinstance(m, _SATURATING)]
    if not names:
        return None
    return make(
        "AG321",
        f"{len(names)} sigmoid/tanh-like modules. fp16 rounds sigmoid(x) to exactly 1 for x > ~8.3 "
        "(tanh for |x| > ~4.5), so log(1 - p) becomes -inf and the gradient vanishes far earlier "
        "than in fp32.",
        evidence={"modules": names[:20]},
        fix="Compute losses from logits (BCEWithLogits, log_softmax) and keep these modules in "
        "fp32 (keep_fp32) if their inputs are large; bf16 has the same rounding near 1.",
    )


def _half_modules(model: nn.Module) -> Finding | None:
    low = {}
    for name, module in model.named_modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        dtypes = {str(t.dtype) for t in tensors if t.dtype in (torch.float16, torch.bfloat16)}
        if dtypes:
            low[name] = sorted(dtypes)
    if not low:
        return None
    return make(
        "AG325",
        f"{len(low)} modules hold fp16/bf16 parameters or buffers (a .half()/.to(dtype) cast). "
        "Autocast already runs their math in low precision; low-precision weights also lose "
        "every update smaller than their rounding step.",
        evidence={"modules": dict(list(low.items())[:20])},
        fix="Keep the model in float32 (drop .half()) and let autocast choose per-op precision.",
    )


def _fp16_optimizer_params(optimizer: torch.optim.Optimizer) -> Finding | None:
    n = sum(p.dtype == torch.float16 for g in optimizer.param_groups for p in g["params"])
    if not n:
        return None
    return make(
        "AG323",
        f"The optimizer holds {n} float16 parameters. With the fp16 loss scaler this fails with "
        "'Attempting to unscale FP16 gradients'; without it, gradients underflow unscaled.",
        evidence={"fp16_params": int(n)},
        fix="Keep parameters in float32 (remove .half()) and train with ag.Guard(precision="
        "'fp16'), or use precision='bf16'.",
    )


def _adam_eps(optimizer: torch.optim.Optimizer) -> Finding | None:
    if type(optimizer).__name__ not in _ADAM_LIKE:
        return None
    bad = []
    for i, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        low = [p for p in group["params"] if p.dtype in (torch.float16, torch.bfloat16)]
        if isinstance(eps, float) and low and float(torch.tensor(eps, dtype=low[0].dtype)) == 0.0:
            bad.append({"group": i, "eps": eps, "dtype": str(low[0].dtype)})
    if not bad:
        return None
    return make(
        "AG324",
        f"{type(optimizer).__name__} eps={bad[0]['eps']} is below the smallest {bad[0]['dtype']} "
        "value, so sqrt(v) + eps can be exactly 0 and the update divides by zero (inf/NaN).",
        evidence={"groups": bad},
        fix="Keep parameters and optimizer state in float32 (autocast handles the math), or raise "
        "eps to at least 1e-4 for half-precision states.",
    )


def _referenced_functions(model: nn.Module) -> dict[type, list[str]]:
    """Custom autograd Functions named in the forward code of the model's own module classes, or
    held as attributes of its modules."""
    found: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__module__.startswith("torch."):
            continue
        forward = getattr(cls, "forward", None)
        code = getattr(forward, "__code__", None)
        fns = [] if code is None else _functions_in(code, getattr(forward, "__globals__", {}))
        fns += [v for v in vars(module).values() if _is_custom_function(v) and v not in fns]
        for fn in fns:
            found.setdefault(fn, []).append(name)
    return found


def _functions_in(code: Any, env: dict[str, Any]) -> list[Any]:
    names = set(code.co_names)
    for const in code.co_consts:  # nested lambdas and comprehensions
        if hasattr(const, "co_names"):
            names |= set(const.co_names)
    out = []
    for n in names:
        obj = env.get(n)
        deeper = isinstance(obj, types.ModuleType) and obj.__name__.split(".")[0] not in (
            "torch",
            "ampguard",
        )
        candidates = [obj] + ([getattr(obj, a, None) for a in names] if deeper else [])
        out += [c for c in candidates if _is_custom_function(c) and c not in out]
    return out


def _is_custom_function(obj: Any) -> bool:
    return (
        isinstance(obj, type)
        and issubclass(obj, torch.autograd.Function)
        and not obj.__module__.startswith("torch.")
    )


def _is_amp_decorated(fn: Any, kind: str) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_name == f"decorate_{kind}" and hasattr(fn, "__wrapped__")


def _custom_function_finding(functions: dict[Any, list[str]]) -> Finding | None:
    """AG322 for Functions (named in a module's forward, or seen in the probe's autograd graph)
    whose forward/backward lack ``torch.amp.custom_fwd``/``custom_bwd``."""
    bad = {
        cls: where
        for cls, where in functions.items()
        if not (_is_amp_decorated(cls.forward, "fwd") and _is_amp_decorated(cls.backward, "bwd"))
    }
    if not bad:
        return None
    names = [f"{c.__module__}.{c.__qualname__}" for c in bad]
    modules = sorted({m or "<root>" for where in bad.values() for m in where})
    used = f" (called in the forward of {', '.join(map(repr, modules[:8]))})" if modules else ""
    return make(
        "AG322",
        f"{', '.join(names)}{used} runs its forward under autocast but its backward without it, "
        "so the backward mixes fp16 saved tensors with fp32 gradients ('expected scalar type "
        "Half but found Float') or silently runs in the wrong dtype.",
        evidence={"functions": names, "modules": modules},
        fix="Decorate forward with @torch.amp.custom_fwd(device_type=...) (cast_inputs="
        "torch.float32 if it needs fp32) and backward with @torch.amp.custom_bwd(...).",
    )
