# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG203 fires: an enabled GradScaler together with bf16 autocast."""
import torch
from torch.amp import GradScaler, autocast

model = torch.nn.Linear(4, 4)
scaler = GradScaler("cuda")  # expect: AG203

for x in [torch.randn(2, 4)]:
    with autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).sum()
    scaler.scale(loss).backward()


class BF16Trainer:
    def __init__(self, use_amp):
        self.amp_dtype = torch.bfloat16
        self.scaler = torch.amp.GradScaler(enabled=use_amp)  # expect: AG203

    def step(self, x, use_amp):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            return model(x).sum()


def cpu_default_is_bf16(x):
    s = torch.amp.GradScaler("cpu")  # expect: AG203
    with torch.autocast("cpu"):
        loss = model(x).sum()
    s.scale(loss).backward()
