"""A hand-written layer norm whose square overflows fp16 and is absorbed by / sqrt(inf) = 0."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Case

NAME = "absorbed_norm"
DESCRIPTION = (
    "hand-written norm: (x - u).pow(2) -> inf, / sqrt(inf) = 0; the layer outputs its bias"
)
EXPECT = {
    "locate": "fp16_overflow_absorbed",
    "guard": "AG170",
    "advisor": "AG361",
    "module": "norm",
}

W = 16


class HandNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        v = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - u) / torch.sqrt(v + 1e-5) + self.bias


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.norm = HandNorm(W)
        self.head = nn.Linear(W, 4)
        with torch.no_grad():
            self.fc.weight.mul_(2000.0)  # activations of a few thousand: their square > 65504

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def build() -> Case:
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, W, generator=g), torch.randint(0, 4, (8,), generator=g))]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Case(model, opt, batches, loss_fn, {"precision": "fp16"}, steps=8)
