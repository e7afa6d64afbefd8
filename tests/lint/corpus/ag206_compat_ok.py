# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG206 look-alikes in compatibility code: the fallback for old torch does not use the old AMP (torch.cuda.amp)
spelling (no scaler at all, a null context), and version gates that are about other APIs."""
import contextlib

import torch

try:
    from torch.amp import GradScaler
except ImportError:  # torch < 2.3: train without loss scaling
    GradScaler = None

if hasattr(torch, "compile"):
    compile_fn = torch.compile
else:
    compile_fn = lambda m: m  # noqa: E731


def autocast_ctx(device, dtype):
    if device == "cpu" and dtype == torch.float16:
        return contextlib.nullcontext()
    return torch.amp.autocast(device, dtype=dtype)


def make_scaler(enabled):
    return GradScaler("cuda", enabled=enabled) if GradScaler is not None else None
