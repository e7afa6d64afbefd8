"""fp16 autocast without a loss scaler: small gradients become subnormals or zero."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Case

NAME = "no_scaler_underflow"
DESCRIPTION = "fp16 without a loss scaler: gradients of order 1e-6 are fp16 subnormals or flushed"
EXPECT = {"locate": "fp16_underflow", "guard": "AG171"}

W = 32


def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y) * 1e-3  # a small loss weight: tiny gradients


def build() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 4))
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(64, W, generator=g), torch.randn(64, 4, generator=g))]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Case(
        model,
        opt,
        batches,
        loss_fn,
        {"precision": "fp16"},
        locate_kwargs={"scale": 1.0},  # the scale this loop really uses
        steps=8,
        loop="watch",
    )
