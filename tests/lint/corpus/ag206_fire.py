# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG206 fires on every deprecated spelling, resolved through imports and aliases."""
import torch
import torch.cuda.amp as cuda_amp
from torch.cuda import amp
from torch.cuda.amp import GradScaler as LegacyScaler
from torch.cuda.amp import autocast

OldScaler = torch.cuda.amp.GradScaler

scaler = amp.GradScaler()  # expect: AG206
other = LegacyScaler(init_scale=1024)  # expect: AG206
third = OldScaler()  # expect: AG206
fourth = torch.cuda.amp.GradScaler(enabled=True)  # expect: AG206


@autocast()  # expect: AG206
def forward(model, x):
    return model(x)


def cpu_region(model, x):
    with torch.cpu.amp.autocast():  # expect: AG206
        return model(x)


def cuda_region(model, x):
    with cuda_amp.autocast(dtype=torch.float16):  # expect: AG206
        return model(x)


class MyFn(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd  # expect: AG206
    def forward(ctx, x):
        return x
