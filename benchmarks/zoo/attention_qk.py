"""Attention whose q @ k.T overflows fp16 before the 1/sqrt(d) scale brings it back."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Case

NAME = "attention_qk"
DESCRIPTION = "attention: q @ k.T passes 65504 before / sqrt(d); the module's fp32 output is fine"
# loud once it trains (softmax of inf is NaN: the Guard skips), but the fp32 module-level probe
# sees nothing: the advisor must catch it before the run, and locate names the op
EXPECT = {"locate": "fp16_overflow", "advisor": "AG361", "module": "attn"}

D = 32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        with torch.no_grad():
            self.q.weight.mul_(150.0)
            self.k.weight.mul_(150.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = (q @ k.transpose(-1, -2)) / D**0.5
        return torch.softmax(scores.float(), -1).to(v.dtype) @ v


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).mean(1).float(), y)


def build() -> Case:
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 8, D, generator=g), torch.randint(0, 4, (2,), generator=g))]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Case(model, opt, batches, loss_fn, {"precision": "fp16"}, steps=4)
