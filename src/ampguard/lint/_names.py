"""Names the rules look for: dotted text of a name chain and the canonical torch spellings."""

from __future__ import annotations

import ast

__all__ = [
    "AUTOCASTS",
    "BCE_FUNCTIONS",
    "BCE_MODULES",
    "CLIPS",
    "DEPRECATED",
    "GRAD_SCALERS",
    "NO_GRAD",
    "SOFTMAXES",
    "FUNCS",
    "canonical",
    "dotted",
    "terminal",
]

FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)  # a ``def`` of either kind
GRAD_SCALERS = frozenset(
    {
        "torch.amp.GradScaler",
        "torch.cuda.amp.GradScaler",
        "torch.cpu.amp.GradScaler",
        "torch.distributed.fsdp.ShardedGradScaler",
    }
)
AUTOCASTS = frozenset({"torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast"})
# deprecated name -> (replacement, device string it needs, how to spell the call)
DEPRECATED: dict[str, tuple[str, str, str]] = {
    "torch.cuda.amp.autocast": ("torch.amp.autocast", "cuda", "torch.amp.autocast('cuda', ...)"),
    "torch.cuda.amp.GradScaler": (
        "torch.amp.GradScaler",
        "cuda",
        "torch.amp.GradScaler('cuda', ...)",
    ),
    "torch.cuda.amp.custom_fwd": (
        "torch.amp.custom_fwd",
        "cuda",
        "torch.amp.custom_fwd(device_type='cuda')",
    ),
    "torch.cuda.amp.custom_bwd": (
        "torch.amp.custom_bwd",
        "cuda",
        "torch.amp.custom_bwd(device_type='cuda')",
    ),
    "torch.cpu.amp.autocast": ("torch.amp.autocast", "cpu", "torch.amp.autocast('cpu', ...)"),
    "torch.cpu.amp.GradScaler": ("torch.amp.GradScaler", "cpu", "torch.amp.GradScaler('cpu', ...)"),
}
CLIPS = frozenset(
    {
        "torch.nn.utils.clip_grad_norm_",
        "torch.nn.utils.clip_grad_value_",
        "torch.nn.utils.clip_grad_norm",
        "torch.nn.utils.clip_grads_with_norm_",
    }
)
NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad"})
SOFTMAXES = frozenset({"torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax"})
BCE_FUNCTIONS = frozenset({"torch.nn.functional.binary_cross_entropy"})
BCE_MODULES = frozenset({"torch.nn.BCELoss"})

# private module paths -> the public spelling (longest prefixes first)
_PREFIXES = (
    ("torch.amp.grad_scaler.", "torch.amp."),
    ("torch.amp.autocast_mode.", "torch.amp."),
    ("torch.cuda.amp.grad_scaler.", "torch.cuda.amp."),
    ("torch.cuda.amp.autocast_mode.", "torch.cuda.amp."),
    ("torch.cpu.amp.grad_scaler.", "torch.cpu.amp."),
    ("torch.cpu.amp.autocast_mode.", "torch.cpu.amp."),
    ("torch.distributed.fsdp.sharded_grad_scaler.", "torch.distributed.fsdp."),
    ("torch.nn.modules.loss.", "torch.nn."),
    ("torch.nn.utils.clip_grad.", "torch.nn.utils."),
    ("torch.serialization.", "torch."),
    ("torch.autograd.grad_mode.", "torch."),
)
_EXACT = {
    "torch.autocast": "torch.amp.autocast",
    "torch.autograd.no_grad": "torch.no_grad",
    "torch.autograd.inference_mode": "torch.inference_mode",
    "torch.autograd.set_grad_enabled": "torch.set_grad_enabled",
    "torch.half": "torch.float16",
    "torch.float": "torch.float32",
}


def canonical(name: str) -> str:
    """Public spelling of a resolved torch name (``torch.autocast`` -> ``torch.amp.autocast``)."""
    if not name.startswith("torch"):
        return name
    for prefix, public in _PREFIXES:
        if name.startswith(prefix):
            name = public + name[len(prefix) :]
            break
    return _EXACT.get(name, name)


def dotted(node: ast.AST | None) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else ``None``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def terminal(func: ast.AST) -> str | None:
    """The last name of a call's function: ``step`` for ``scaler.step``, ``print`` for ``print``."""
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None
