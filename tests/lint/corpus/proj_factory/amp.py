# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""The project's AMP helpers: a GradScaler factory and autocast contexts."""
import contextlib

import torch


def create_grad_scaler(enabled=True):
    return torch.amp.GradScaler("cuda", enabled=enabled)


def autocast_ctx(dtype=torch.float16, enabled=True):
    return torch.autocast("cuda", dtype=dtype, enabled=enabled)


@contextlib.contextmanager
def maybe_autocast(enabled):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled):
        yield


class AmpTools:
    def __init__(self, precision):
        self.scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")


@contextlib.contextmanager
def warmed_up(model):
    with torch.autocast("cuda", dtype=torch.float16):
        model(torch.zeros(1, 4))  # compiles the kernels; the caller's block runs outside
    yield
