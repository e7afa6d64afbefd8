# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG204 fires: a scaler built here is stepped (in a function) and never updated."""
import torch

model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
grad_scaler = torch.amp.GradScaler()


def train_step(x):
    grad_scaler.scale(model(x).sum()).backward()
    grad_scaler.step(opt)  # expect: AG204
    opt.zero_grad()
