# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG206 where the old entry point is bound to a name that a branch reassigns (NPU/XPU support in
public training code), so its calls cannot be followed back to it: reported where it is bound."""
import torch


def f(device):
    amp_autocast = torch.cuda.amp.autocast  # expect: AG206
    if "npu" in str(device):
        amp_autocast = torch.npu.amp.autocast
    with amp_autocast(enabled=True):
        pass


class Runner:
    def __init__(self, device):
        self.scaler_cls = torch.cuda.amp.GradScaler  # expect: AG206
        if device == "xpu":
            self.scaler_cls = torch.xpu.amp.GradScaler
        self.scaler = self.scaler_cls()
