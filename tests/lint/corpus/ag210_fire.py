# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG210 fires: BCE (function or module) inside an autocast region."""
import torch
import torch.nn as nn
import torch.nn.functional as F

model = nn.Linear(4, 1)
criterion = nn.BCELoss()


class Trainer:
    def __init__(self):
        self.loss_fn = nn.BCELoss(reduction="mean")

    def step(self, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            return self.loss_fn(torch.sigmoid(model(x)), y)  # expect: AG210


def train(x, y):
    with torch.amp.autocast("cuda"):
        p = torch.sigmoid(model(x))
        a = F.binary_cross_entropy(p, y)  # expect: AG210
        b = criterion(p, y)  # expect: AG210
        c = nn.BCELoss()(p, y)  # expect: AG210
    return a + b + c
