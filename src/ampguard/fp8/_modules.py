"""Matmul-bearing modules that fp8 training cannot convert, and the exact Conv1D -> Linear swap.

torchao's float8 training converts ``nn.Linear`` only. Other modules do matmuls with their own
weights and stay in bf16 under ``precision="fp8"``, often holding most of a model's compute:

- ``transformers``' ``Conv1D`` (GPT-2, GPT-Neo's ancestors, DistilGPT-2: every attention and MLP
  projection): a Linear with its weight stored transposed, ``(in, out)``;
  :func:`conv1d_to_linear` swaps it for ``nn.Linear`` exactly;
- ``nn.MultiheadAttention``'s input projection (``in_proj_weight``, a bare parameter; its
  ``out_proj`` is a Linear and is converted);
- ``nn.Bilinear``, and 1x1 convolutions (``nn.Conv1d/2d/3d`` and their transposes: fp8 training
  has no convolution kernels; a 1x1 one is a Linear over the channels). Larger kernels (a ViT's
  patch embedding) are not reported: no rewrite applies to them.

:func:`unconvertible` finds them (the plan reports them: AG355). This module needs torch only;
``Conv1D`` is recognised by its class name and layout, without importing transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["unconvertible", "is_hf_conv1d", "conv1d_to_linear", "CONV1D_FIX"]

CONV1D_FIX = (
    "ag.conv1d_to_linear(model) swaps every transformers Conv1D for an equal nn.Linear (weights "
    "transposed, fp32 outputs bitwise equal); call it after loading the weights and before "
    "building the optimizer, then plan again"
)
_CONVS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for a ``transformers`` ``Conv1D`` (``weight`` of shape ``(nx, nf)``, ``nf`` outputs)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and type(module).__module__.startswith("transformers")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and getattr(module, "nf", None) == weight.shape[1]
    )


def unconvertible(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every module of ``model`` that does a matmul with its own weight but is not an
    ``nn.Linear`` fp8 training could convert: ``{name: {"type", "shape", "reason", "fix"}}`` in
    module order. Cost: one walk over the modules, no tensor op.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            continue
        entry = _describe(module)
        if entry is not None:
            out[name] = {"type": type(module).__name__, **entry}
    return out


def _describe(module: nn.Module) -> dict[str, Any] | None:
    if is_hf_conv1d(module):
        nx, nf = _weight(module).shape
        return {
            "shape": [int(nx), int(nf)],
            "reason": "transformers Conv1D (a Linear with its weight transposed): torchao "
            "converts nn.Linear only, so it stays in bf16",
            "fix": CONV1D_FIX,
        }
    if isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
        return {
            "shape": [int(module.embed_dim), int(module.in_proj_weight.shape[0])],
            "reason": "nn.MultiheadAttention's input projection is a bare parameter "
            "(in_proj_weight), not an nn.Linear: it stays in bf16 (its out_proj is converted)",
            "fix": "write the q/k/v projections as nn.Linear layers (with "
            "F.scaled_dot_product_attention) to train them in fp8; or accept them in bf16",
        }
    if isinstance(module, nn.Bilinear):
        return {
            "shape": [int(module.in1_features), int(module.out_features)],
            "reason": "nn.Bilinear is not an nn.Linear: it stays in bf16",
            "fix": "none in fp8 training; it trains in bf16",
        }
    if isinstance(module, _CONVS):
        if any(k != 1 for k in module.kernel_size):
            return None  # a real convolution (a ViT's patch embedding): no Linear to write
        return {
            "shape": [int(module.in_channels), int(module.out_channels)],
            "reason": f"{type(module).__name__}: fp8 training has no convolution kernels, it "
            "stays in bf16",
            "fix": "none in fp8 training; it trains in bf16 (a 1x1 convolution can be written "
            "as an nn.Linear over the channels)",
        }
    return None


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace every ``transformers`` ``Conv1D`` in ``model`` by an equal ``nn.Linear``, in
    place; return ``model``.

    The Linear's weight is the Conv1D's transposed (``(out, in)``, made contiguous) and its bias
    the same values, on the same device and dtype, with the same ``requires_grad``; its
    ``weight.t()`` has the Conv1D weight's exact layout, so fp32 outputs are bitwise equal
    (``addmm`` over the same memory). The parameters are new tensors: call it after loading a
    checkpoint into the model and before building the optimizer (an optimizer built earlier
    would update the old ones). ``state_dict`` keys stay the same, with ``weight`` transposed.
    A model with no Conv1D is returned unchanged. Raises ``TypeError`` for a non-module.
    Cost: one copy of each Conv1D weight.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_hf_conv1d(model):
        raise ValueError(
            "model is itself a Conv1D; conv1d_to_linear replaces Conv1D children in place, "
            "so pass the model that holds it"
        )
    targets = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if is_hf_conv1d(child)
    ]
    for parent, child_name, conv in targets:
        setattr(parent, child_name, _as_linear(conv))
    return model


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    return weight


def _as_linear(conv: nn.Module) -> nn.Linear:
    weight = _weight(conv)
    bias = getattr(conv, "bias", None)
    nx, nf = weight.shape
    linear = nn.Linear(nx, nf, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(
        weight.detach().t().contiguous(), requires_grad=weight.requires_grad
    )
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
    linear.train(conv.training)
    return linear
