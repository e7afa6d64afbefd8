"""Pure-bf16 weights whose Adam updates are below half an ulp: the loss stalls, nothing is inf."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Case

NAME = "bf16_stagnation"
DESCRIPTION = (
    "model.to(bfloat16) + Adam(lr=1e-4): updates below half an ulp of the large first-layer "
    "weights round away; the loss stalls with nothing non-finite"
)
EXPECT = {"locate": "precision_stagnation", "guard": "AG175", "module": "0"}

W = 32


def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x.to(torch.bfloat16)).float(), y)


def build() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 4))
    with torch.no_grad():
        model[0].weight.mul_(4.0)  # |w| up to ~0.7: a bf16 spacing of 2**-8 there
        model[2].weight.mul_(0.05)  # |w| < 0.01: spacing <= 2**-14, these updates survive
    model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, W, generator=g), torch.randn(16, 4, generator=g)) for _ in range(2)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return Case(
        model,
        opt,
        batches,
        loss_fn,
        {"precision": "bf16"},
        locate_kwargs={"optimizer": opt},
        steps=4,
    )
