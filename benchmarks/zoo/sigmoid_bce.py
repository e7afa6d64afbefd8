"""A sigmoid feeding binary_cross_entropy: one confidently wrong sample rounds to exactly 1.0."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Case

NAME = "sigmoid_bce"
DESCRIPTION = "sigmoid -> BCE: in fp16 one confidently wrong probability rounds to exactly 1.0"
# only 1 of 64 probabilities saturates: below the 10% share at which AG321 warns
EXPECT = {"advisor": "AG362", "module": "act"}

D = 32


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 1)
        self.act = nn.Sigmoid()
        with torch.no_grad():
            self.fc.weight.mul_(7.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)).squeeze(-1)


def loss_fn(model, batch):
    return F.binary_cross_entropy(model(batch[0]).float(), batch[1])


def build() -> Case:
    torch.manual_seed(0)
    model = Classifier()
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(64, D, generator=g), (torch.rand(64, generator=g) > 0.5).float())]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Case(model, opt, batches, loss_fn, {"precision": "fp16"}, steps=4)
