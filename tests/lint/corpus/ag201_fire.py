# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG201 fires: clipping after scale(loss).backward() with no unscale_ in the step."""
import torch
from torch.nn.utils import clip_grad_norm_

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")


def train(loader):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        clip_grad_norm_(model.parameters(), 1.0)  # expect: AG201
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def train_conditional_clip(loader, max_norm):
    for x, y in loader:
        loss = model(x).sum()
        scaler.scale(loss).backward()
        if max_norm:
            torch.nn.utils.clip_grad_value_(model.parameters(), max_norm)  # expect: AG201
        scaler.step(optimizer)
        scaler.update()


def clip_everything(net):
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)  # expect: AG201


def train_clip_in_helper(loader):
    for x, _ in loader:
        loss = model(x).sum()
        scaled = scaler.scale(loss)
        scaled.backward()
        clip_everything(model)
        scaler.step(optimizer)
        scaler.update()
