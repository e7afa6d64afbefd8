# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG206 look-alikes: the torch.amp spellings and unrelated names called autocast/GradScaler."""
import torch
from torch import amp
from torch.amp import GradScaler


class autocast:  # noqa: N801 - a local class with the same name
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


scaler = GradScaler("cuda")
s2 = amp.GradScaler("cpu")
with torch.amp.autocast("cuda"):
    pass
with torch.autocast(device_type="cuda", dtype=torch.float16):
    pass
with autocast():
    pass


@torch.amp.custom_fwd(device_type="cuda")
def f(x):
    return x
