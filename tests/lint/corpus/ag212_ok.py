# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG212 look-alikes: scaling in training code, unscale_ under no_grad, test functions."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()


def train_step(x):
    scaler.scale(model(x).sum()).backward()
    with torch.no_grad():
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def test_scaler_round_trip():
    s = torch.amp.GradScaler("cpu")
    assert s.state_dict()


def evaluate(loader):
    with torch.no_grad():
        return sum(model(x).sum().item() for x in loader)
