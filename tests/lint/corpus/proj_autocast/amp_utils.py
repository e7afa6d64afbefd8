# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""A project's own autocast helpers: each forwards ``enabled=`` (by name, with a default, or in
``**kwargs``) to torch.amp.autocast."""
import contextlib

import torch


def autocast(enabled=True, dtype=torch.float16, **kwargs):
    return torch.amp.autocast("cuda", enabled=enabled, dtype=dtype, **kwargs)


def maybe_autocast(**kwargs):
    return torch.autocast(device_type="cuda", dtype=torch.float16, **kwargs)


@contextlib.contextmanager
def precision_ctx(enabled=True):
    with torch.autocast("cuda", dtype=torch.float16, enabled=enabled):
        yield
