# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG206 stays quiet on names bound to the current entry points, reassigned or not."""
import torch


def f(device):
    amp_autocast = torch.amp.autocast
    if "npu" in str(device):
        amp_autocast = torch.npu.amp.autocast
    with amp_autocast("cuda", enabled=True):
        pass
