# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG206 on compatibility code for old torch, reported one way (info, with the version the new
spelling needs) for import-level and call-level fallbacks alike: try/except imports, a version
gate, a feature probe, a try around the constructor (detection and speech repositories do this)."""
import torch
from packaging import version

try:
    from torch.amp import GradScaler, autocast
except ImportError:
    from torch.cuda.amp import GradScaler, autocast  # expect: AG206

TORCH_2_3 = version.parse(torch.__version__) >= version.parse("2.3")

if TORCH_2_3:
    from torch.amp import custom_fwd
else:
    from torch.cuda.amp import custom_fwd  # expect: AG206


def make_scaler(enabled):
    if version.parse(torch.__version__) >= version.parse("2.3"):
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return GradScaler(enabled=enabled)


def make_scaler_probe(enabled):
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", enabled=enabled)
    else:
        return torch.cuda.amp.GradScaler(enabled=enabled)  # expect: AG206


def make_scaler_try(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)  # expect: AG206


amp_autocast = torch.amp.autocast if hasattr(torch.amp, "autocast") else torch.cuda.amp.autocast  # expect: AG206


def train_step(model, x, scaler):
    with autocast("cuda", dtype=torch.float16):
        loss = model(x)
    scaler.scale(loss).backward()


def forward_half(model, x, torch_dtype):
    if torch_dtype == torch.float16:  # about the dtype, not the torch version: no fallback
        with torch.cuda.amp.autocast():  # expect: AG206
            return model(x)
    return model(x)
