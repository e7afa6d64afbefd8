# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG212 fires: GradScaler or scaler.scale in no-grad / evaluation code."""
import torch

model = torch.nn.Linear(4, 4)
scaler = torch.amp.GradScaler()


def evaluate(loader):
    total = 0.0
    for x in loader:
        loss = model(x).sum()
        total += scaler.scale(loss)  # expect: AG212
    return total


@torch.no_grad()
def validation_loss(x):
    local = torch.amp.GradScaler()  # expect: AG212
    return local


def train(x):
    with torch.inference_mode():
        scaler.scale(model(x).sum())  # expect: AG212
