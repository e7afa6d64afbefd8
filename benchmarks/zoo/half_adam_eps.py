"""A .half() model trained with Adam's default eps=1e-8, which is 0 in fp16."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Case

NAME = "half_adam_eps"
DESCRIPTION = (
    "model.half() + Adam(eps=1e-8): eps rounds to 0 in fp16, m / (sqrt(v) + eps) divides by zero "
    "where v flushed, and the weights turn NaN in the optimizer step, not in the model"
)
EXPECT = {"locate": "eps_underflow", "advisor": "AG324"}

W = 16


def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x.half()).float(), y)


def build() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, 32), nn.ReLU(), nn.Linear(32, 4)).half()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, W, generator=g), torch.randn(16, 4, generator=g)) for _ in range(2)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Case(
        model,
        opt,
        batches,
        loss_fn,
        # fp16 weights cannot take a loss scaler (torch refuses to unscale fp16 gradients): the
        # plain fp16 loop this models has none, so the zoo watches it (ag.watch(None, ...))
        {"precision": "fp16"},
        locate_kwargs={"optimizer": opt},
        steps=4,
        loop="watch",
    )
